"""Helpers of tests/serving/test_serving_api.py: a stream's log-probs per choice, a choice's
text, and a stop string that ends a beam of a served decode midway (kept apart so the test file
stays one screenful of tests)."""

from __future__ import annotations

from typing import Any

from deployments.api.responses import BeamText
from dsbd_core.algorithm.sequences.stops import StopStrings
from dsbd_core.models.token_bytes import TokenizerTexts


def per_choice(chunks, chat: bool) -> dict[int, list]:
    """The logprobs entries of a stream, per choice: (token, logprob, top tokens)."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            logprobs = choice.logprobs
            if logprobs is None:
                continue
            if chat:
                entries = [
                    (c.token, c.logprob, [t.token for t in c.top_logprobs])
                    for c in logprobs.content
                ]
            else:
                entries = [
                    (t, p, sorted(top))
                    for t, p, top in zip(
                        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
                    )
                ]
            out.setdefault(choice.index, []).extend(entries)
    return out


def choice_text(choice: Any, chat: bool) -> str:
    return (choice.message.content if chat else choice.text) or ""


def stop_case(server, reference, texts: BeamText, prompt: list[int]) -> tuple:
    """A dsbd decode of `prompt` (knobs, seed) and a stop string of two of its middle tokens
    that ends a beam there: knobs, the stop, the in-process decode with it, its text view."""
    vocabulary = TokenizerTexts(str(server["target"]))
    for seed in range(4, 40):  # a decode long enough to meet a stop midway
        knobs = {"seed": seed, "max_new_tokens": 10, "width": 2, "gamma": 2}
        free = reference("dsbd", prompt, **knobs).beams[0].token_ids
        for i in range(1, len(free) - 2):  # two tokens from the middle of it
            candidate = texts.decode(free[i : i + 2])
            stop = StopStrings((candidate,), vocabulary)
            want = reference("dsbd", prompt, stop=stop, **knobs)
            view = texts.with_stops([candidate], False)
            if candidate.strip() and any(view.stop_reason(b) for b in want.beams):
                return knobs, candidate, want, view
    raise AssertionError("no stop of two tokens ends a beam")
