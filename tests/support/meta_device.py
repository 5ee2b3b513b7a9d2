"""The check that the engine makes no tensor off its state's device, on the CPU: a decode with
torch's default device set to `meta` (the state on the CPU, the scorers' calls run with the CPU
default again: `OnHost`) gives the plain decode's tokens (tests/algorithm/test_engine_device.py
says why). `same_decodes` runs it on PROMPTS."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsbd_core import SamplingConfig, generate_batch
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import tiny

PROMPTS = [[1, 2, 3, 4], [5, 6], [8, 9, 10, 11, 12, 13]]


class OnHost:
    """A scorer whose calls run with the CPU as the default device again."""

    def __init__(self, inner: TransformerScorer) -> None:
        self.inner = inner

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def engine_device(self) -> torch.device:
        return torch.device("cpu")

    def set_roots(self, roots: Roots) -> None:
        with torch.device("cpu"):
            self.inner.set_roots(roots)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        with torch.device("cpu"):
            return self.inner.forward(layers)

    def release(self) -> None:
        self.inner.release()


def same_decodes(
    method: str, fields: dict, scorer: type[TransformerScorer], draft: torch.nn.Module
) -> None:
    """`method` on `tiny("llama", 1)` and `draft` under `scorer`, decoded with torch's default
    device `meta` (the state and the scorers' calls on the CPU), gives the plain decode's
    tokens, log-likelihoods and statistics."""
    target = tiny("llama", 1).float()
    config = SamplingConfig(max_new_tokens=10, eos_token_ids=(0,), seed=3, **fields)
    plain = generate_batch(method, scorer(target), PROMPTS, config, scorer(draft))
    with torch.device("meta"):
        placed = generate_batch(
            method, OnHost(scorer(target)), PROMPTS, config, OnHost(scorer(draft))
        )
    for got, want in zip(placed, plain, strict=True):
        assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
        assert [b.log_likelihood for b in got.beams] == [b.log_likelihood for b in want.beams]
        assert got.stats == want.stats
