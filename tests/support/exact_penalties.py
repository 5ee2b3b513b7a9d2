"""The penalised model of the exactness references: a language model with OpenAI's, vLLM's and
transformers' per-beam processors applied, written from their definitions (docs/SERVING.md) in
plain numpy, with no import of `dsbd_core` and no code shared with `penalties.py`.

`PenalisedLM` wraps any model with `next_logprobs(seq)` over whole sequences (`TableLM`, a
transformers model's rows) and is itself one, so the enumerations of `exact_reference` and
`exact_transformers` state the penalised law unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


class RowModel(Protocol):
    vocab_size: int

    def next_logprobs(self, seq: Sequence[int]) -> np.ndarray: ...


class PenalisedLM:
    """`lm` with, in transformers' order, logit_bias, repetition_penalty (on log-probs: seen
    tokens' values times the penalty where negative, divided where not), frequency and presence
    penalties over the generated tokens, and min_tokens (EOS ids impossible before that many
    generated tokens). `normalise`: renormalise each row (the paper's law, sampling); without
    it the rows are transformers' processed log-probs (its beam methods)."""

    def __init__(
        self,
        lm: RowModel,
        prompt_len: int,
        *,
        eos: Iterable[int] = (),
        min_tokens: int = 0,
        frequency: float = 0.0,
        presence: float = 0.0,
        repetition: float = 1.0,
        bias: dict[int, float] | None = None,
        normalise: bool = True,
    ) -> None:
        self.lm, self.prompt_len = lm, prompt_len
        self.vocab_size = lm.vocab_size
        self.eos = sorted(set(eos))
        self.min_tokens, self.frequency, self.presence = min_tokens, frequency, presence
        self.repetition, self.bias, self.normalise = repetition, dict(bias or {}), normalise

    def next_logprobs(self, seq: Sequence[int]) -> np.ndarray:
        x = np.array(self.lm.next_logprobs(seq), dtype=np.float64)
        for token, bias in self.bias.items():
            x[token] += bias
        if self.repetition != 1.0:
            for token in set(int(t) for t in seq):
                value = x[token]
                x[token] = value * self.repetition if value < 0 else value / self.repetition
        generated = [int(t) for t in seq[self.prompt_len :]]
        for token, n in Counter(generated).items():
            x[token] -= self.frequency * n + self.presence
        if len(generated) < self.min_tokens:
            x[self.eos] = -np.inf
        if self.normalise:
            finite = x[np.isfinite(x)]
            x = x - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))
        return x

    def sequence_logprob(self, prompt: Sequence[int], tokens: Sequence[int]) -> float:
        """The processed log-likelihood of `tokens` after `prompt` (the beams' scores)."""
        seq, total = list(prompt), 0.0
        for token in tokens:
            total += float(self.next_logprobs(seq)[token])
            seq.append(token)
        return total
