"""Exactness with float32 tables: what a bfloat16 or float32 model's scorer hands the engine.

The engine keeps the candidate tables in the dtype the scorer returns (float32 for every real model
that is not float64) and accumulates the beams' log-likelihoods in float64. These tests run the
statistical checks of tests/algorithm/test_exactness.py with the exact n-gram tables rounded to
float32 on the way out of the scorer: DSBD must still follow the (float32-rounded) target's beam
sampling, at the threshold of a null run of an exact sampler at the same sample size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from dsbd_core import ForestLayer, ForestLogprobs, SamplingConfig, TableScorer, generate_batch
from dsbd_core.algorithm.scorer import Roots
from tests.support.beam_search import outcomes_of
from tests.support.exact_reference import (
    TableLM,
    assert_matches,
    beam_sampling_outcomes,
    random_table,
)

RUNS = 100_000
V = 4
EOS = 0
PROMPT = [1]
MAX_NEW = 3


class Float32Scorer:
    """A TableScorer whose log-probabilities come out in float32, like a real model's."""

    def __init__(self, table: np.ndarray) -> None:
        rounded = torch.from_numpy(table).to(torch.float32).log_softmax(-1)
        self.table = rounded.to(torch.float64).numpy()  # what the engine really samples from
        self.inner = TableScorer(torch.from_numpy(self.table))

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        self.inner.set_roots(roots)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        out = self.inner.forward(layers)
        roots = out.roots.to(torch.float32) if out.roots is not None else None
        return ForestLogprobs(roots, [x.to(torch.float32) for x in out.layers])

    def release(self) -> None:
        self.inner.release()


def _decode(method: str, target: Float32Scorer, draft: Float32Scorer | None, **fields) -> list:
    config = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), **fields)
    return generate_batch(method, target, [PROMPT] * RUNS, config, draft)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "width", "gamma"),
    [
        ("distinct", 3, 2),
        ("distinct", 2, 3),
        ("with_replacement", 2, 2),
    ],
)
def test_fixed_width_dsbd_on_float32_tables_equals_target_beam_sampling(
    mode: str, width: int, gamma: int
) -> None:
    rng = np.random.default_rng(100 + width + gamma)
    target = Float32Scorer(random_table(rng, V, 2, concentration=1.0))
    draft = Float32Scorer(random_table(rng, V, 2, concentration=1.0, zero_prob=0.3))
    results = _decode(
        "dsbd", target, draft, width=width, gamma=gamma, threshold=None, mode=mode, seed=3
    )
    assert all(r.beams[0].log_likelihood <= 0 for r in results[:100])
    exact = beam_sampling_outcomes(TableLM(target.table), PROMPT, width, MAX_NEW, mode, {EOS})
    assert_matches(outcomes_of(results), exact, f"float32 dsbd {mode} W={width} gamma={gamma}")
    assert any(sum(r.stats.accepted_layers) > 0 for r in results[:1000])


def test_scores_stay_float64_log_likelihoods() -> None:
    """The returned log-likelihood is the float64 sum of the tokens' log-probabilities."""
    rng = np.random.default_rng(7)
    target = Float32Scorer(random_table(rng, V, 2, concentration=1.0))
    draft = Float32Scorer(random_table(rng, V, 2, concentration=1.0))
    config = SamplingConfig(
        max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), width=2, gamma=2, threshold=None, seed=1
    )
    (result,) = generate_batch("dsbd", target, [PROMPT], config, draft)
    for beam in result.beams:
        context, total = PROMPT[-1], 0.0
        for token in beam.token_ids:
            total += float(target.table[context, token])
            context = token
        assert beam.log_likelihood == pytest.approx(total, abs=1e-6)
