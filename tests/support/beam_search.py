"""What the beam tests share: our methods on transformers models against transformers' own
searches (`ours`, `assert_same_hypotheses`), and transformers' sampled beams against the
enumeration of its law (`ModelLM`, `as_sets`, `until_eos`); and the sets of sequences
each session returned (`outcomes_of`), which the exactness tests compare with the laws."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from dsbd_core import SamplingConfig, generate
from dsbd_core.models.transformer_scorer import TransformerScorer


def ours(
    method: str,
    target: torch.nn.Module,
    prompt: list[int],
    draft: torch.nn.Module | None,
    **knobs: Any,
):
    """`method` of ours on `target` (and `draft`) with TransformerScorers, `knobs` the
    SamplingConfig."""
    config = SamplingConfig(**knobs)
    return generate(
        method,
        TransformerScorer(target),
        prompt,
        config,
        TransformerScorer(draft) if draft is not None else None,
    )


def assert_same_hypotheses(
    result, expected: list[tuple[list[int], float | None]], context: Any
) -> None:
    """Our hypotheses are `expected`'s (generated ids, score), best first, token for token,
    scores to 1e-4 where given, finished exactly when they end in one of `context["eos"]`."""
    assert [b.token_ids for b in result.beams] == [ids for ids, _ in expected], context
    for beam, (_, score) in zip(result.beams, expected, strict=True):
        if score is not None:
            assert beam.score == pytest.approx(score, abs=1e-4, rel=1e-5), context
        assert beam.finished == (beam.token_ids[-1] in context["eos"]), context


def outcomes_of(results: list) -> list[tuple[tuple[int, ...], ...]]:
    """The W returned sequences of each session, as a set (sorted): n-gram tables give exact
    ties in score (the same transitions in another order), whose order is arbitrary."""
    return [tuple(sorted(tuple(beam.token_ids) for beam in r.beams)) for r in results]


def as_sets(exact: dict) -> dict:
    """An enumerated law over ordered outcomes as one over sets of sequences (sorted)."""
    merged: dict = {}
    for key, p in exact.items():
        merged[tuple(sorted(key))] = merged.get(tuple(sorted(key)), 0.0) + p
    return merged


class ModelLM:
    """The tiny model's next-token log-probs (float64) with `TableLM`'s interface."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model, self.vocab_size = model, model.config.vocab_size
        self.cache: dict[tuple[int, ...], np.ndarray] = {}

    def next_logprobs(self, seq: tuple[int, ...]) -> np.ndarray:
        key = tuple(seq)
        if key not in self.cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([key])).logits[0, -1].to(torch.float64)
            self.cache[key] = torch.log_softmax(logits, -1).numpy()
        return self.cache[key]


def until_eos(row: list[int], eos: int) -> tuple[int, ...]:
    """A returned row's generated tokens up to and including its EOS (the rest is padding)."""
    return tuple(row[: row.index(eos) + 1]) if eos in row else tuple(row)
