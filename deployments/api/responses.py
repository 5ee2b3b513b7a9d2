"""The OpenAI-shaped replies of the router: completions and chat completions from the decoded
beams, with the text the client sees (special tokens and the stop token left out) and, when
asked, the tokens' log-probabilities in OpenAI's two formats.

Stop strings (`BeamText.with_stops`): a beam the engine finished at a stop string keeps every
token (its log-probs list them all, as vLLM's do) and its text ends before the first stop
string in it (`include_stop_str_in_output`: after it); `stop_reason` names that string.

The log-probabilities are the ones the engine tracked while decoding (`Beam.token_logprobs`,
`Beam.top_logprobs`: the target's raw distribution, docs/SERVING.md). The OpenAI routes list the
tokens of the returned text, so a beam that ended in a stop token lists every token but that
one, as its text leaves it out; the native route lists them all.
"""

from __future__ import annotations

import math
from typing import Any

from deployments.api.models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from dsbd_core.algorithm.sequences.prompt_logprobs import PromptLogprobs
from dsbd_core.algorithm.sequences.result import Beam
from dsbd_core.algorithm.sequences.stop_text import first_stop, text_floor

# OpenAI's stand-in for a log-probability of minus infinity (JSON has no infinity).
FLOOR = -9999.0


class BeamText:
    """Token ids to the text a client sees, with the target's tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        stops: tuple[str, ...] = (),
        include_stop: bool = False,
        stop_ids: tuple[int, ...] = (),
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}
        self.stops = stops  # a request's stop strings (`with_stops`)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.stop_ids = stop_ids  # a request's stop_token_ids (vLLM's; stop_reason names one)
        self.min_tokens = min_tokens  # vLLM's: no stop string counts before it

    def with_stops(
        self,
        stops: list[str],
        include_stop: bool,
        stop_ids: list[int] | None = None,
        min_tokens: int = 0,
    ) -> BeamText:
        """This text view for a request with stop strings or stop token ids (shares the token
        pieces)."""
        if not stops and not stop_ids:
            return self
        view = BeamText(
            self.tokenizer, tuple(stops), include_stop, tuple(stop_ids or ()), min_tokens
        )
        view._pieces = self._pieces
        return view

    def stop_floor(self, token_ids: list[int]) -> int:
        """Characters of the text no stop match may end within (`stop_text.text_floor`)."""
        if not self.stops:
            return 0
        return text_floor(self.decode, token_ids, self.min_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stopped_at(self, beam: Beam) -> tuple[str, str] | None:
        """A beam finished at a stop string: its text cut there and that string; else None."""
        if not (beam.finished and self.stops):
            return None
        text = self.decode(beam.token_ids)
        found = first_stop(text, self.stops, self.stop_floor(beam.token_ids))
        if found is None:
            return None
        at, stop = found
        return self.cut(text, at, stop), stop

    def cut(self, text: str, at: int, stop: str) -> str:
        """`text` where a stop string starts at `at`: before it, or through it."""
        return text[: at + len(stop)] if self.include_stop else text[:at]

    def visible_ids(self, beam: Beam) -> list[int]:
        """The beam's tokens without its stop token (OpenAI leaves the stop sequence out); a
        beam finished at a stop string keeps them all (its text is cut instead)."""
        ids = beam.token_ids
        if self.stopped_at(beam) is not None:
            return ids
        return ids[:-1] if beam.finished and ids else ids

    def text(self, beam: Beam) -> str:
        """The beam's text without its stop token, or cut at its stop string."""
        stopped = self.stopped_at(beam)
        if stopped is not None:
            return stopped[0]
        return self.decode(self.visible_ids(beam))

    def stop_reason(self, beam: Beam) -> str | int | None:
        """vLLM's `stop_reason`: the stop string the beam finished at, or the request's stop
        token id it ended with (None: the model's EOS, length)."""
        stopped = self.stopped_at(beam)
        if stopped is not None:
            return stopped[1]
        if beam.finished and beam.token_ids and beam.token_ids[-1] in self.stop_ids:
            return beam.token_ids[-1]
        return None

    def piece(self, token_id: int) -> str:
        """One token's text (as vLLM reports it: the token decoded alone)."""
        if token_id not in self._pieces:
            self._pieces[token_id] = self.tokenizer.decode([token_id])
        return self._pieces[token_id]

    def chat_logprobs(
        self, ids: list[int], chosen: list[float], tops: list[list[tuple[int, float]]]
    ) -> ChatLogprobs:
        """OpenAI chat's `logprobs.content` for these tokens."""
        content = []
        for token, logprob, top in zip(ids, chosen, tops, strict=True):
            text = self.piece(token)
            alternatives = [
                TopLogprob(
                    token=self.piece(t), logprob=_finite(p), bytes=list(self.piece(t).encode())
                )
                for t, p in top
            ]
            content.append(
                TokenLogprob(
                    token=text,
                    logprob=_finite(logprob),
                    bytes=list(text.encode()),
                    top_logprobs=alternatives,
                )
            )
        return ChatLogprobs(content=content)

    def completion_logprobs(
        self,
        all_ids: list[int],
        start: int,
        chosen: list[float],
        tops: list[list[tuple[int, float]]],
    ) -> CompletionLogprobs:
        """OpenAI completions' `logprobs` for tokens `all_ids[start:start + len(chosen)]`; text
        offsets count from the start of the whole choice's text."""
        ids = all_ids[start : start + len(chosen)]
        tokens = [self.piece(t) for t in ids]
        top_dicts = []
        for token, logprob, top in zip(ids, chosen, tops, strict=True):
            entry = {self.piece(t): _finite(p) for t, p in top}
            entry.setdefault(self.piece(token), _finite(logprob))  # OpenAI: the chosen one too
            top_dicts.append(entry)
        offsets = [len(self.decode(all_ids[:i])) for i in range(start, start + len(ids))]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[_finite(p) for p in chosen],
            top_logprobs=top_dicts,
            text_offset=offsets,
        )

    def prompt_logprobs(self, ids: list[int], scored: PromptLogprobs) -> CompletionLogprobs:
        """OpenAI completions' `logprobs` of an echoed prompt: the first token has none (null,
        as OpenAI and vLLM give it), every other its log-probability given the ones before."""
        rest = self.completion_logprobs(ids, 1, scored.token_logprobs, scored.top_logprobs)
        return _joined(
            CompletionLogprobs(
                tokens=[self.piece(ids[0])],
                token_logprobs=[None],
                top_logprobs=[None],
                text_offset=[0],
            ),
            rest,
        )

    def beam_logprobs(
        self, beam: Beam, *, chat: bool, start: int = 0
    ) -> ChatLogprobs | CompletionLogprobs | None:
        """The beam's visible tokens from `start` on, in the route's format (None when the
        decode tracked no log-probs)."""
        if beam.token_logprobs is None or beam.top_logprobs is None:
            return None
        ids = self.visible_ids(beam)
        chosen, tops = beam.token_logprobs[start : len(ids)], beam.top_logprobs[start : len(ids)]
        if chat:
            return self.chat_logprobs(ids[start:], chosen, tops)
        return self.completion_logprobs(ids, start, chosen, tops)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def finish_reason(beam: Beam) -> str:
    return "stop" if beam.finished else "length"


def usage(prompt_ids: list[int], beams: list[Beam]) -> Usage:
    return summed_usage([prompt_ids], [beams])


def summed_usage(prompts: list[list[int]], beams: list[list[Beam]]) -> Usage:
    """Usage over a batch: every prompt's tokens and every returned beam's."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(b.token_ids) for group in beams for b in group)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
    )


def batch_completion_response(
    model_name: str, prompts: list[list[int]], beams: list[list[Beam]], n: int, texts: BeamText
) -> CompletionResponse:
    """The reply to a list of prompts: prompt i's beams are choices i x n + j, best first
    (OpenAI's order), and usage sums over the prompts."""
    return CompletionResponse(
        model=model_name,
        usage=summed_usage(prompts, beams),
        choices=[
            CompletionChoice(
                index=i * n + j,
                text=texts.text(b),
                logprobs=texts.beam_logprobs(b, chat=False),
                finish_reason=finish_reason(b),
                stop_reason=texts.stop_reason(b),
            )
            for i, group in enumerate(beams)
            for j, b in enumerate(group)
        ],
    )


def completion_response(
    model_name: str, prompt_ids: list[int], beams: list[Beam], texts: BeamText, *, chat: bool
) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed reply: one choice per returned beam, best first."""
    usage_ = usage(prompt_ids, beams)
    if chat:
        return ChatCompletionResponse(
            model=model_name,
            usage=usage_,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=texts.text(b)),
                    logprobs=texts.beam_logprobs(b, chat=True),
                    finish_reason=finish_reason(b),
                    stop_reason=texts.stop_reason(b),
                )
                for i, b in enumerate(beams)
            ],
        )
    return CompletionResponse(
        model=model_name,
        usage=usage_,
        choices=[
            CompletionChoice(
                index=i,
                text=texts.text(b),
                logprobs=texts.beam_logprobs(b, chat=False),
                finish_reason=finish_reason(b),
                stop_reason=texts.stop_reason(b),
            )
            for i, b in enumerate(beams)
        ],
    )


def native_beam_logprobs(beam: Beam, texts: BeamText) -> dict[str, Any]:
    """The native route's per-beam log-probs: every generated token (the stop token included),
    summing to the beam's log_likelihood."""
    assert beam.token_logprobs is not None and beam.top_logprobs is not None
    return {
        "token_logprobs": beam.token_logprobs,
        "top_logprobs": [
            [{"token_id": t, "token": texts.piece(t), "logprob": _finite(p)} for t, p in top]
            for top in beam.top_logprobs
        ],
    }


def echo_completion_response(
    model_name: str,
    prompts: list[list[int]],
    beams: list[list[Beam]],
    scored: list[PromptLogprobs | None],
    n: int,
    texts: BeamText,
) -> CompletionResponse:
    """The reply with `echo`: each choice's text is its prompt's, then the beam's (none with
    `max_tokens: 0`); with `logprobs`, the prompt's tokens come first in the log-probs, then
    every token the beam generated (its stop token included), offsets counted over the whole
    text. Choices i x n + j, usage summed."""
    choices = []
    for i, (ids, group, prompt_scored) in enumerate(zip(prompts, beams, scored, strict=True)):
        for j in range(n):
            beam = group[j] if group else None
            visible = texts.visible_ids(beam) if beam is not None else []
            logprobs = None
            if prompt_scored is not None:
                logprobs = texts.prompt_logprobs(ids, prompt_scored)
                if beam is not None and beam.token_logprobs is not None and beam.top_logprobs:
                    # every generated token, a stop token too: a client reading the prompt's
                    # log-probs then the `max_tokens` generated ones (lm-evaluation-harness)
                    # counts on their number
                    generated = texts.completion_logprobs(
                        ids + beam.token_ids, len(ids), beam.token_logprobs, beam.top_logprobs
                    )
                    logprobs = _joined(logprobs, generated)
            choices.append(
                CompletionChoice(
                    index=i * n + j,
                    text=_echoed(texts, ids, beam, visible),
                    logprobs=logprobs,
                    finish_reason=finish_reason(beam) if beam is not None else "length",
                    stop_reason=texts.stop_reason(beam) if beam is not None else None,
                )
            )
    return CompletionResponse(model=model_name, choices=choices, usage=summed_usage(prompts, beams))


def _echoed(texts: BeamText, ids: list[int], beam: Beam | None, visible: list[int]) -> str:
    """An echoed choice's text: the prompt's and the beam's (cut at its stop string)."""
    if beam is not None and texts.stopped_at(beam) is not None:
        return texts.decode(ids) + texts.text(beam)
    return texts.decode(ids + visible)


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
        text_offset=first.text_offset + then.text_offset,
    )
