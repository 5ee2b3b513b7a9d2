"""The joint beam distribution and the exact draws (ALGORITHM.md §12.2 items 10-11, §1.1)."""

import math

import pytest
import torch

from dsbd_core.algorithm.draws.distributions import draw_distinct, joint_filter, residual
from dsbd_core.algorithm.draws.streams import Draws
from tests.support.exact_reference import assert_matches


def test_joint_filter_without_filters_is_the_normalised_sequence_probability() -> None:
    scores = torch.tensor([[-0.5], [-2.0]], dtype=torch.float64)
    logp = torch.log_softmax(torch.randn(2, 5, dtype=torch.float64), -1)
    table = (scores + logp).reshape(1, -1)
    probs = joint_filter(table, 1.0, 0, 1.0)
    expected = torch.exp(table) / torch.exp(table).sum()
    assert torch.allclose(probs, expected, atol=1e-12)


def test_joint_filter_is_invariant_to_a_constant_shift() -> None:
    table = torch.randn(3, 10, dtype=torch.float64)
    for top_k, top_p, temp in [(0, 1.0, 1.0), (4, 1.0, 0.7), (0, 0.8, 1.3), (5, 0.9, 2.0)]:
        a = joint_filter(table, temp, top_k, top_p)
        b = joint_filter(table + 7.5, temp, top_k, top_p)
        assert torch.allclose(a, b, atol=1e-12)


def test_joint_top_k_keeps_exactly_k_plus_ties() -> None:
    table = torch.tensor([[0.0, 3.0, 1.0, 2.0, 2.0, -1.0]], dtype=torch.float64)
    assert int((joint_filter(table, 1.0, 3, 1.0) > 0).sum()) == 3
    assert int((joint_filter(table, 1.0, 2, 1.0) > 0).sum()) == 3  # tie with the 2nd value


def test_joint_top_p_keeps_the_crossing_entry() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    kept = joint_filter(probs.log(), 1.0, 0, 0.7) > 0
    assert kept.tolist() == [[True, True, False, False]]
    kept = joint_filter(probs.log(), 1.0, 0, 0.5) > 0
    assert kept.tolist() == [[True, False, False, False]]


def test_rows_without_mass_give_zeros_not_nan() -> None:
    table = torch.full((2, 4), float("-inf"), dtype=torch.float64)
    table[1, 2] = 0.0
    probs = joint_filter(table, 1.0, 2, 0.9)
    assert not torch.isnan(probs).any()
    assert probs[0].sum() == 0 and probs[1, 2] == 1.0


def test_residual_sums_to_one_and_mass_identity() -> None:
    gen = torch.Generator().manual_seed(1)
    c = torch.rand(50, 7, generator=gen, dtype=torch.float64)
    c /= c.sum(-1, keepdim=True)
    q = torch.rand(50, 7, generator=gen, dtype=torch.float64)
    q /= q.sum(-1, keepdim=True)
    r = residual(c, q)
    assert torch.allclose(r.sum(-1), torch.ones(50, dtype=torch.float64))
    assert bool((r[q >= c] == 0).all())
    alpha = torch.minimum(c, q).sum(-1)
    assert torch.allclose(alpha + (c - q).clamp_min(0).sum(-1), torch.ones(50, dtype=torch.float64))


@pytest.mark.parametrize("n", [2, 3])
def test_distinct_draws_are_sequential_sampling_without_replacement(n: int) -> None:
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    runs = 100_000
    index, conditional, exists = draw_distinct(probs.expand(runs, -1).clone(), n, Draws.seeded(2))
    assert bool(exists.all())
    samples = [tuple(row) for row in index.tolist()]

    def ordered(seq: tuple[int, ...]) -> float:
        used, out = 0.0, 1.0
        for x in seq:
            out *= float(probs[x]) / (1.0 - used)
            used += float(probs[x])
        return out

    import itertools

    exact = {s: ordered(s) for s in itertools.permutations(range(5), n)}
    assert_matches(samples, exact, f"distinct top-{n}")
    # the reported conditional probability is that of the sequential draw
    first = index[0].tolist()
    used = 0.0
    for j, x in enumerate(first):
        assert math.isclose(float(conditional[0, j]), float(probs[x]) / (1 - used), rel_tol=1e-12)
        used += float(probs[x])


def test_distinct_draws_at_the_edges_of_the_mass() -> None:
    """Candidates without mass are never drawn; past the candidates with mass a draw does not
    exist (and no later one); a row without mass draws nothing; columns of zeros appended (a
    padded bucket) move no draw."""
    probs = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.5, 0.0],  # two candidates with mass
            [0.0, 0.0, 0.0, 0.0, 0.0],  # none
            [1.0, 0.0, 0.0, 0.0, 0.0],  # one, at the first index
            [0.0, 0.0, 0.0, 0.0, 1.0],  # one, at the last
        ],
        dtype=torch.float64,
    )
    index, conditional, exists = draw_distinct(probs, 4, Draws.seeded(0))
    assert exists.tolist() == [
        [True, True, False, False],
        [False, False, False, False],
        [True, False, False, False],
        [True, False, False, False],
    ]
    assert sorted(index[0, :2].tolist()) == [1, 3]
    assert index[2, 0] == 0 and index[3, 0] == 4
    assert bool((index >= 0).all() & (index < 5).all())
    assert conditional[0, :2].tolist() == [0.5, 1.0] and conditional[1].tolist() == [0.0] * 4
    rows = torch.rand(64, 30, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    rows = rows**3 / (rows**3).sum(-1, keepdim=True)
    padded = torch.cat([rows, torch.zeros(64, 9, dtype=torch.float64)], dim=1)
    a = draw_distinct(rows, 5, Draws.seeded(1))
    b = draw_distinct(padded, 5, Draws.seeded(1))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert bool(a[2].all())
    assert all(len(set(row)) == 5 for row in a[0].tolist())  # distinct
