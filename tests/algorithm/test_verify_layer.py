"""Single-layer slot exactness (ALGORITHM.md §12.1 items 1-3), batched over 2e5 independent runs.

A layer has parents x V candidates. Parent row 1 is *rejected* (its drafts exist, but the target
gives it no mass), the draft has zero mass on a candidate the target likes, and W >= K. The first
K output slots must be i.i.d. P (with_replacement) or an ordered without-replacement sample of P
(distinct), pass and fail branches together.
"""

import itertools

import pytest
import torch

from dsbd_core.algorithm.draws.distributions import draw_distinct, draw_with_replacement
from dsbd_core.algorithm.draws.streams import Draws
from dsbd_core.algorithm.iteration.verify import fill_failed_layer, verify_layer
from tests.support.exact_reference import assert_matches

RUNS = 200_000
V = 3
# Candidates: parent 0 -> 0..2, parent 1 (rejected parent) -> 3..5, parent 2 -> 6..8.
P = torch.tensor([0.35, 0.0, 0.25, 0.0, 0.0, 0.0, 0.1, 0.2, 0.1], dtype=torch.float64)
FAR = torch.tensor([0.05, 0.3, 0.0, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
# Close to P (so layers pass often) but still zero where P has mass and mass on the bad parent.
NEAR = torch.tensor([0.45, 0.0, 0.0, 0.05, 0.05, 0.0, 0.1, 0.25, 0.1], dtype=torch.float64)
Q = FAR
PROPOSALS = {"far": FAR, "near": NEAR}
VALID_PARENT = torch.tensor([True, False, True])


def run_layer(
    drafts_n: int, k: int, slots: int, distinct: bool, seed: int, q: torch.Tensor = FAR
) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    gen = Draws.seeded(seed)
    target = P.expand(RUNS, -1).clone()
    proposal = q.expand(RUNS, -1).clone()
    if distinct:
        drafts, prob, exists = draw_distinct(proposal, drafts_n, gen)
    else:
        drafts, exists = draw_with_replacement(proposal, drafts_n, gen)
        prob = proposal.gather(1, drafts)
    valid_rows = VALID_PARENT.repeat_interleave(V).expand(RUNS, -1)
    parent_valid = VALID_PARENT[drafts // V] & exists
    width = torch.full((RUNS,), k)
    active = torch.ones(RUNS, dtype=torch.bool)
    verdict = verify_layer(
        target,
        proposal,
        valid_rows,
        drafts,
        prob,
        exists,
        parent_valid,
        width,
        active,
        distinct,
        gen,
    )
    remaining = torch.full((RUNS,), slots)
    index, out_exists = fill_failed_layer(verdict, drafts, target, slots, remaining, distinct, gen)
    passed = verdict.count == k
    # A passed layer's slots are its accepted drafts; a failed one's come from the fill.
    rank = torch.arange(drafts_n).expand(RUNS, -1)
    order = torch.where(verdict.accepted, rank, rank + drafts_n).argsort(dim=1, stable=True)
    accepted_first = drafts.gather(1, order)[:, :k]
    slots_taken = torch.where(passed[:, None], accepted_first, index[:, :k])
    assert bool(out_exists[:, :k].all())
    return [tuple(row) for row in slots_taken.tolist()], passed


def iid(seq: tuple[int, ...]) -> float:
    out = 1.0
    for x in seq:
        out *= float(P[x])
    return out


def without_replacement(seq: tuple[int, ...]) -> float:
    if len(set(seq)) < len(seq):
        return 0.0
    used, out = 0.0, 1.0
    for x in seq:
        out *= float(P[x]) / (1.0 - used)
        used += float(P[x])
    return out


def assert_both_branches(passed: torch.Tensor) -> None:
    n_pass = int(passed.sum())
    assert 100 <= n_pass <= RUNS - 100, f"both branches must be exercised ({n_pass} passed)"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drafts_n", "k", "proposal"),
    [
        (2, 2, "far"),
        (3, 3, "far"),
        (3, 2, "far"),
        (4, 2, "far"),
        (1, 1, "far"),
        (4, 1, "far"),
        (3, 3, "near"),
        (4, 2, "near"),
    ],
)
def test_iid_slots_are_iid_target_draws(drafts_n: int, k: int, proposal: str) -> None:
    q = PROPOSALS[proposal]
    samples, passed = run_layer(drafts_n, k, max(k, drafts_n), False, seed=k, q=q)
    assert_both_branches(passed)
    exact = {s: iid(s) for s in itertools.product(range(len(P)), repeat=k) if iid(s) > 0}
    assert_matches(samples, exact, f"iid W_S={drafts_n} K={k} {proposal}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drafts_n", "k", "proposal"),
    [(2, 2, "far"), (4, 2, "far"), (3, 3, "near"), (4, 4, "near"), (4, 2, "near")],
)
def test_distinct_slots_are_a_without_replacement_sample(
    drafts_n: int, k: int, proposal: str
) -> None:
    q = PROPOSALS[proposal]
    samples, passed = run_layer(drafts_n, k, max(k, drafts_n), True, seed=10 + k, q=q)
    assert_both_branches(passed)
    support = [s for s in itertools.permutations(range(len(P)), k) if without_replacement(s) > 0]
    exact = {s: without_replacement(s) for s in support}
    assert_matches(samples, exact, f"distinct W_S={drafts_n} K={k} {proposal}")


@pytest.mark.slow
def test_the_reference_codes_rule_with_distinct_drafts_is_biased() -> None:
    """ALGORITHM.md §4.5, §12.1 item 3: drafts without replacement verified with the i.i.d.
    rule. The harness must see the bias (this guards the power of the tests above)."""
    gen = Draws.seeded(5)
    target = P.expand(RUNS, -1).clone()
    proposal = Q.expand(RUNS, -1).clone()
    drafts, _, exists = draw_distinct(proposal, 3, gen)
    prob = proposal.gather(1, drafts)  # unconditional probability: the biased rule
    valid_rows = VALID_PARENT.repeat_interleave(V).expand(RUNS, -1)
    parent_valid = VALID_PARENT[drafts // V] & exists
    width = torch.full((RUNS,), 2)
    verdict = verify_layer(
        target,
        proposal,
        valid_rows,
        drafts,
        prob,
        exists,
        parent_valid,
        width,
        torch.ones(RUNS, dtype=torch.bool),
        False,
        gen,
    )
    index, _ = fill_failed_layer(verdict, drafts, target, 3, torch.full((RUNS,), 3), False, gen)
    rank = torch.arange(3).expand(RUNS, -1)
    order = torch.where(verdict.accepted, rank, rank + 3).argsort(dim=1, stable=True)
    slots = torch.where((verdict.count == 2)[:, None], drafts.gather(1, order)[:, :2], index[:, :2])
    samples = [tuple(row) for row in slots.tolist()]
    exact = {s: iid(s) for s in itertools.product(range(len(P)), repeat=2) if iid(s) > 0}
    with pytest.raises(AssertionError):
        assert_matches(samples, exact, "biased rule")
