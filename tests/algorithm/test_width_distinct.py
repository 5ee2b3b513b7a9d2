"""Dynamic width for distinct drafts: the estimate matches the rule it stands for.

Reference: the distinct rule itself, simulated on the full layer (every candidate, 20k layers:
drafts by `draw_distinct`, verification by `verify_layer`), against which both the i.i.d. DP
and the estimate of `dsbd_core.algorithm.iteration.width_distinct` (a reduced layer, few
simulations) are
judged.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from dsbd_core.algorithm.draws.distributions import draw_distinct
from dsbd_core.algorithm.draws.streams import Draws
from dsbd_core.algorithm.iteration.verify import verify_layer
from dsbd_core.algorithm.iteration.width import acceptance_alphas, acceptance_count_distribution
from dsbd_core.algorithm.iteration.width_distinct import (
    distinct_count_tails,
    distinct_layer_width,
    small_layer,
)

RUNS = 10_000  # full-layer simulations: standard error <= 0.005


def peaky(top_p: float, top_q: float, size: int = 1000, seed: int = 1) -> tuple:
    """One parent; a likely token both models agree on and a long tail they share loosely."""
    g = torch.Generator().manual_seed(seed)
    tail = torch.rand(size - 1, generator=g, dtype=torch.float64) ** 4
    other = tail + 0.5 * torch.rand(size - 1, generator=g, dtype=torch.float64) ** 4
    p = torch.cat([torch.tensor([top_p]), (1 - top_p) * tail / tail.sum()])
    q = torch.cat([torch.tensor([top_q]), (1 - top_q) * other / other.sum()])
    return p[None], q[None], torch.ones(1, size, dtype=torch.bool)


def flat(size: int = 1000, seed: int = 2) -> tuple:
    """Mass spread over hundreds of tokens, the two models only loosely alike."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(size, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(size, generator=g, dtype=torch.float64) ** 3 + p
    return (p / p.sum())[None], (q / q.sum())[None], torch.ones(1, size, dtype=torch.bool)


def forest_layer(seed: int = 3) -> tuple:
    """Three parents x 400 tokens, the second parent rejected: P lives on parents 0 and 2, the
    draft table on all three (its drafts on parent 1 are auto-rejected)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 400
    rows = torch.rand(3, vocab, generator=g, dtype=torch.float64) ** 6
    rows[:, 0] += torch.tensor([30.0, 5.0, 12.0])  # each parent's likely token
    q = rows.reshape(1, -1) + 0.2 * torch.rand(1, 3 * vocab, generator=g, dtype=torch.float64)
    valid = torch.tensor([True, False, True]).repeat_interleave(vocab)[None]
    p = (rows.reshape(1, -1) ** 1.3) * valid
    return p / p.sum(), q / q.sum(), valid


@cache
def reference(name: str, m: int) -> torch.Tensor:
    return simulated_tails(*LAYERS[name], m)


def simulated_tails(p, q, valid, m: int, seed: int = 0) -> torch.Tensor:
    """Pr[N >= k] of the distinct rule on the full layer, by simulation."""
    g = Draws.seeded(seed)
    pb, qb, vb = (x.expand(RUNS, -1).contiguous() for x in (p, q, valid))
    index, prob, exists = draw_distinct(qb, m, g)
    verdict = verify_layer(
        pb,
        qb,
        vb,
        index,
        prob,
        exists,
        exists & vb.gather(1, index),
        torch.full((RUNS,), m),
        torch.ones(RUNS, dtype=torch.bool),
        True,
        g,
    )
    counts = torch.bincount(verdict.count, minlength=m + 1).double() / RUNS
    return counts.flip(0).cumsum(0).flip(0)


def dp_tails(p, q, valid, m: int) -> torch.Tensor:
    table = acceptance_count_distribution(acceptance_alphas(p, q * valid, m))[0, m]
    return table.flip(0).cumsum(0).flip(0)


def estimated_tails(p, q, valid, m: int, samples: int, seed: int = 7) -> torch.Tensor:
    g = Draws.seeded(seed)
    return distinct_count_tails(p, q, valid, torch.tensor([m]), m, g, samples=samples)[0]


LAYERS = {
    "peaky .9/.85": peaky(0.9, 0.85),
    "peaky .7/.6": peaky(0.7, 0.6),
    "flat": flat(),
    "forest, rejected parent": forest_layer(),
}


@pytest.mark.slow
def test_the_iid_dp_overrates_distinct_drafts_on_a_peaky_layer() -> None:
    """Why the estimate exists: three distinct acceptances are far rarer than the DP says."""
    p, q, valid = LAYERS["peaky .9/.85"]
    dp, real = dp_tails(p, q, valid, 3), reference("peaky .9/.85", 3)
    assert dp[3] - real[3] > 0.2, (dp, real)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("m", [2, 3, 4])
def test_the_reduced_layer_gives_the_full_layers_count_distribution(name: str, m: int) -> None:
    """The reduction (top candidates kept, the rest in stand-ins) changes Pr[N >= k] by < 0.03:
    checked with enough simulations (8192) that their own noise (< 0.006) does not hide it."""
    p, q, valid = LAYERS[name]
    real = reference(name, m)
    estimate = estimated_tails(p, q, valid, m, samples=8192)
    assert torch.allclose(estimate, real, atol=0.03, rtol=0), (name, m, estimate, real)


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.slow  # over a second: outside the quick loop
def test_the_default_estimate_is_within_its_noise(name: str) -> None:
    p, q, valid = LAYERS[name]
    real = reference(name, 3)
    estimate = estimated_tails(p, q, valid, 3, samples=256)  # the engine's default
    assert torch.allclose(estimate, real, atol=0.1, rtol=0), (name, estimate, real)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_the_reduced_layer_keeps_masses_and_the_first_acceptance(name: str) -> None:
    p, q, valid = LAYERS[name]
    small_p, small_q, small_valid = small_layer(p, q, valid, keep=64, spread=8)
    assert torch.allclose(small_p.sum(-1), p.sum(-1))
    assert torch.allclose(small_q.sum(-1), q.sum(-1))
    assert torch.allclose((small_q * small_valid).sum(-1), (q * valid).sum(-1))
    # the first draft's acceptance sum min(P, Q~): a stand-in group never straddles P = Q
    first = torch.minimum(small_p, small_q * small_valid).sum(-1)
    assert torch.allclose(first, torch.minimum(p, q * valid).sum(-1))


def test_the_threshold_now_holds_where_the_dp_broke_it() -> None:
    """t = 0.7 on the peaky layer: the DP asked for width 3 (passes ~0.6 of the time), the
    estimate for the widest width whose real pass rate is >= 0.7."""
    p, q, valid = LAYERS["peaky .9/.85"]
    real = reference("peaky .9/.85", 3)
    g = Draws.seeded(11)
    width = int(
        distinct_layer_width(p, q, valid, torch.tensor([3]), 3, 0.7, 1, torch.tensor([3]), g)
    )
    assert real[width] >= 0.7 - 0.03, (width, real)
    assert width == max(k for k in range(4) if real[k] >= 0.7)


def test_sessions_without_drafts_and_w_min() -> None:
    p, q, valid = LAYERS["flat"]
    g = Draws.seeded(0)
    two = (p.expand(2, -1), q.expand(2, -1), valid.expand(2, -1))
    tails = distinct_count_tails(*two, torch.tensor([0, 2]), 2, g)
    assert tails[0].tolist() == [1.0, 0.0, 0.0] and tails[1, 0] == 1.0
    widths = distinct_layer_width(*two, torch.tensor([0, 2]), 2, 0.99, 1, torch.tensor([3, 3]), g)
    assert widths[0] == 1  # no drafts: w_min
