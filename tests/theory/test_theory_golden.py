"""Deterministic checks of dsbd.theory: THEORY.md §8.1 golden values, single-step
exactness (P1, P7), closed forms of the batch improvement (P10, P12), Theorems 4-5 (P13-P15)
and the ε rule's closed forms (P16-P19)."""

from __future__ import annotations

import numpy as np
import pytest

from dsbd.theory import (
    batch_improvement,
    batch_root_law,
    expected_rejections_batch,
    expected_rejections_batch_limit,
    expected_rejections_sd,
    golden_chain,
    least_bias,
    overaccept_bias,
    overaccept_chain,
    overaccept_layer,
    overaccept_rejection,
    overaccept_step_law,
    random_chain,
    rejection_probability,
    rejections_per_position_sd,
    residual_chain,
    sd_step_law,
    tv,
)
from dsbd.theory.distributions import (
    bernoulli_batch_improvement,
    uniform_batch_improvement,
)
from dsbd.theory.pareto import (
    least_bias_paper_form,
    optimal_resample_bound,
    output_law,
    pareto_front,
)
from dsbd.theory.sd import expected_calls_sd

EXACT = 1e-12


# ------------------------------------------------------------------------------- §8.1 golden
def test_theorem1_golden_value() -> None:
    chain = golden_chain()
    assert abs(expected_rejections_sd(chain) - 0.508) < EXACT
    assert np.allclose(rejections_per_position_sd(chain), [0.2, 0.16, 0.148], atol=EXACT)
    assert abs(expected_calls_sd(chain) - (1 + 0.2 + 0.16)) < EXACT


@pytest.mark.parametrize(
    ("drafts", "value"),
    [(1, 0.508), (2, 0.449376), (3, 0.412711), (4, 0.386736), (8, 0.330200)],
)
def test_theorem3_golden_values(drafts: int, value: float) -> None:
    # THEORY.md §8.1 prints six decimals; M = 1 and 2 are exact decimals.
    got = expected_rejections_batch(golden_chain(), drafts)
    assert abs(got - value) < (EXACT if drafts <= 2 else 5e-7)


def test_theorem3_with_one_draft_is_theorem1() -> None:
    chain = random_chain(np.random.default_rng(1), 5, 12)
    assert abs(expected_rejections_batch(chain, 1) - expected_rejections_sd(chain)) < EXACT


def test_proposition1_golden_limit() -> None:
    chain = golden_chain()
    assert abs(expected_rejections_batch_limit(chain) - 0.292) < EXACT
    assert abs(expected_rejections_batch(chain, 4096) - 0.292) < 1e-9


@pytest.mark.parametrize(("drafts", "value"), [(2, 0.12), (3, 0.204), (6, 0.332772)])
def test_bernoulli_batch_improvement_golden(drafts: int, value: float) -> None:
    target, draft = np.array([0.7, 0.3]), np.array([0.3, 0.7])  # Ber(0.3) target, Ber(0.7) draft
    assert abs(batch_improvement(target, draft, drafts) - value) < EXACT
    assert abs(bernoulli_batch_improvement(0.7, 0.3, drafts) - value) < EXACT


@pytest.mark.parametrize(("drafts", "value"), [(2, 0.222222), (5, 0.534979)])
def test_uniform_batch_improvement_golden(drafts: int, value: float) -> None:
    target = np.r_[np.full(4, 0.25), np.zeros(8)]
    got = batch_improvement(target, np.full(12, 1 / 12), drafts)
    assert abs(got - uniform_batch_improvement(3.0, drafts)) < EXACT
    assert abs(got - value) < 5e-7


def test_support_floor_golden() -> None:
    target, draft = np.array([0.5, 0.3, 0.2]), np.array([0.6, 0.4, 0.0])
    for drafts in (2, 3, 10, 50):
        r, _ = residual_chain(target, draft, drafts)
        assert abs(r.prod() - 0.2) < EXACT


def test_overacceptance_worked_example() -> None:
    """§5.4: TV 0.4, b = (0.6, 1, 1, ·), R 0.2, Loss* 0.2, A = (-0.5, 0, -0.5, 2),
    OPT law (0.3, 0.3, 0.2, 0.2) with TV 0.2, UNO law (0.34, 0.36, 0.22, 0.08) with TV 0.32."""
    draft, target, eps = np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.2, 0.3, 0.1, 0.4]), 0.1
    assert abs(tv(target, draft) - 0.4) < EXACT
    assert abs(overaccept_rejection(target, draft, eps) - 0.2) < EXACT
    assert abs(overaccept_bias(target, draft, eps) - 0.2) < EXACT
    accept = np.array([0.6, 1.0, 1.0, 1.0])
    assert np.allclose(
        optimal_resample_bound(target, draft, accept), [-0.5, 0, -0.5, 2], atol=EXACT
    )
    opt, uno = (overaccept_step_law(target, draft, eps, m) for m in ("opt", "uno"))
    assert np.allclose(opt, [0.3, 0.3, 0.2, 0.2], atol=EXACT) and abs(tv(opt, target) - 0.2) < EXACT
    assert np.allclose(uno, [0.34, 0.36, 0.22, 0.08], atol=EXACT)
    assert abs(tv(uno, target) - 0.32) < EXACT


# ------------------------------------------------------------------------------- exactness
def _random_pairs(rng: np.random.Generator, count: int = 300):
    for _ in range(count):
        v = int(rng.integers(2, 10))
        a = float(rng.choice([0.2, 1.0, 3.0]))
        target, draft = rng.dirichlet(np.full(v, a)), rng.dirichlet(np.full(v, a))
        if rng.random() < 0.3:  # tokens the draft never proposes
            draft[rng.integers(v)] = 0.0
            draft /= draft.sum()
        yield target, draft


def test_single_step_sd_and_batch_root_laws_are_the_target() -> None:
    """P1, P7 (also vectorised: a whole batch of rows in one call)."""
    worst = 0.0
    for target, draft in _random_pairs(np.random.default_rng(0)):
        worst = max(worst, np.abs(sd_step_law(target, draft) - target).max())
        for drafts in (1, 2, 5, 8):
            worst = max(worst, np.abs(batch_root_law(target, draft, drafts) - target).max())
    assert worst < EXACT
    rng = np.random.default_rng(1)
    targets, drafts = rng.dirichlet(np.ones(6), size=(4, 5)), rng.dirichlet(np.ones(6), size=(4, 5))
    assert np.abs(batch_root_law(targets, drafts, 3) - targets).max() < EXACT


def test_batch_improvement_is_nonnegative_with_the_marginal_gain_formula() -> None:
    """P10: BI_{M+1} - BI_M = (Π_{m≤M} r_m)(1 - r_{M+1}) >= 0."""
    for target, draft in _random_pairs(np.random.default_rng(2), 100):
        r, _ = residual_chain(target, draft, 7)
        for m in range(1, 7):
            gain = batch_improvement(target, draft, m + 1) - batch_improvement(target, draft, m)
            assert gain >= -EXACT
            assert abs(gain - r[:m].prod() * (1 - r[m])) < EXACT


def test_rejections_non_increasing_in_drafts_and_above_the_limit() -> None:
    """P11 (observed property, not a theorem): 20 random chains."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        chain = random_chain(rng, 4, 6, concentration=0.7, draft_noise=1.0)
        values = [expected_rejections_batch(chain, m) for m in range(1, 10)]
        assert np.all(np.diff(values) <= EXACT)
        limit = expected_rejections_batch_limit(chain)
        assert 0 < limit <= values[-1] + EXACT


# ------------------------------------------------------------------------------- Theorems 4, 5
def test_theorem4_value_and_theorem5_front_for_any_overacceptance() -> None:
    """P13-P15 for arbitrary over-accepting b between min(1, t/d) and 1: the least-bias forms
    agree, R + Loss* = TV, the bound A admits an optimal law attaining Loss*, and random
    resampling laws never do better."""
    rng = np.random.default_rng(4)
    for target, draft in _random_pairs(rng, 200):
        safe = np.where(draft > 0, draft, 1.0)
        low = np.where(draft > 0, np.minimum(1.0, target / safe), 1.0)
        accept = low + rng.random(len(target)) * (1 - low)
        rejection = rejection_probability(draft, accept)
        loss = least_bias(target, draft, accept)
        assert abs(rejection + loss - tv(target, draft)) < EXACT
        if rejection < 1e-9:
            continue
        assert abs(loss - least_bias_paper_form(target, draft, accept)) < EXACT
        bound = optimal_resample_bound(target, draft, accept)
        best = np.maximum(bound, 0.0) / np.maximum(bound, 0.0).sum()  # normalise([A]_+)
        assert abs(tv(output_law(target, draft, accept, best), target) - loss) < EXACT
        others = rng.dirichlet(np.ones(len(target)), size=50)
        assert (tv(output_law(target, draft, accept, others), target) >= loss - EXACT).all()


def test_pareto_front_is_the_segment() -> None:
    rejection, bias = pareto_front(0.4, 5)
    assert np.allclose(rejection + bias, 0.4) and rejection[0] == 0.4 and bias[0] == 0.0


# ------------------------------------------------------------------------------- ε rule
def test_epsilon_rule_closed_forms_and_limits() -> None:
    """P16-P19: OPT's TV equals Loss*(ε) = TV - R(ε); UNO is never better; monotone in ε;
    ε = 0 is SD; large ε accepts everything with bias TV; the bias may exceed ε."""
    rng = np.random.default_rng(5)
    exceeded = False
    for target, draft in _random_pairs(rng, 200):
        total = tv(target, draft)
        previous = (total + 1.0, -1.0)
        for eps in (0.0, 0.01, 0.05, 0.1, 0.3, 1.0):
            rejection = overaccept_rejection(target, draft, eps)
            bias = overaccept_bias(target, draft, eps)
            opt = overaccept_step_law(target, draft, eps, "opt")
            uno = overaccept_step_law(target, draft, eps, "uno")
            assert abs(tv(opt, target) - bias) < EXACT and abs(bias - (total - rejection)) < EXACT
            assert tv(uno, target) >= bias - EXACT
            assert rejection <= previous[0] + EXACT and bias >= previous[1] - EXACT
            assert bias <= min(total, eps * (draft > target).sum()) + EXACT
            exceeded |= bias > eps + 1e-9
            previous = (rejection, bias)
        assert abs(overaccept_rejection(target, draft, 0.0) - total) < EXACT
        assert np.abs(overaccept_step_law(target, draft, 0.0) - target).max() < EXACT
        assert overaccept_rejection(target, draft, 1.0) == 0.0
    assert exceeded, "the bias can exceed ε (THEORY.md §8.2, P19): the bound is not 'within ε'"


def test_epsilon_layer_bias_bound_dominates_the_layer_bias() -> None:
    """THEORY.md §9.3 item 6 [derived]: K = 1 layer with M drafts, ε at every stage; ε = 0 exact."""
    for target, draft in _random_pairs(np.random.default_rng(6), 200):
        for drafts in (1, 2, 4):
            law, _, bound = overaccept_layer(target, draft, drafts, 0.0)
            assert np.abs(law - target).max() < EXACT and bound == 0.0
            for eps in (0.02, 0.1, 0.4):
                law, rejection, bound = overaccept_layer(target, draft, drafts, eps)
                assert abs(law.sum() - 1.0) < EXACT
                assert tv(law, target) <= bound + EXACT
            if drafts == 1:
                assert abs(rejection - overaccept_rejection(target, draft, eps)) < EXACT
                assert abs(bound - overaccept_bias(target, draft, eps)) < EXACT


def test_opt_lies_on_the_chain_level_front_and_uno_above() -> None:
    chain = random_chain(np.random.default_rng(7), 5, 8)
    for eps in (0.0, 0.05, 0.2):
        opt = overaccept_chain(chain, eps, "opt", "target")
        uno = overaccept_chain(chain, eps, "uno", "target")
        assert abs(opt["rejections"] + opt["bias"] - opt["front"]) < 1e-10
        assert uno["rejections"] == opt["rejections"] and uno["bias"] >= opt["bias"] - EXACT
        assert abs(opt["front"] - expected_rejections_sd(chain)) < 1e-10
    own = overaccept_chain(chain, 0.0, "opt", "own")
    assert abs(own["rejections"] - expected_rejections_sd(chain)) < 1e-10 and own["bias"] < 1e-12
