"""The online acceptance predictor and the (gamma, draft width) rule
(dsbd/theory/predictor).

Checks the formulas, the rule's behaviour at the extremes and its monotonicity, the running
estimate and the probing, and — on the real engine — Theorem 1's per-layer identity that the
predictor rests on: with one draft per layer, the number of rejected layers of a request has
the same mean as Σ (1 - α_1) over its verified layers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsbd.theory.predictor import (
    AcceptanceEstimate,
    CostModel,
    PairTracker,
    Plan,
    acceptance_count_pmf,
    choose_plan,
    expected_accepted_length,
    layer_pass_probability,
    plan_config,
    predicted_rejections,
    tokens_per_iteration,
    update_estimate,
)
from dsbd_core import SamplingConfig, TableScorer, generate_batch
from dsbd_core.algorithm.iteration.width import acceptance_count_distribution
from dsbd_core.algorithm.sequences.result import DecodeStats


def test_tokens_and_accepted_length() -> None:
    assert tokens_per_iteration(0.5, 3) == pytest.approx(1.875)
    assert expected_accepted_length(0.5, 3) == pytest.approx(0.875)
    assert tokens_per_iteration([0.5, 0.4, 1.0], 3) == pytest.approx(1 + 0.5 + 0.2 + 0.2)
    assert tokens_per_iteration(0.9, 0) == 1.0 and tokens_per_iteration(1.0, 4) == 5.0
    assert predicted_rejections([0.25, 1.0, 0.5]) == pytest.approx(1.25)


def test_binomial_model_is_the_width_dp_with_constant_alphas() -> None:
    for alpha in (0.1, 0.45, 0.9):
        for drafts in (1, 2, 5):
            dp = acceptance_count_distribution(torch.full((1, drafts), alpha, dtype=torch.float64))
            assert np.allclose(acceptance_count_pmf(alpha, drafts), dp[0, drafts].numpy())


def test_layer_pass_probability() -> None:
    assert layer_pass_probability(0.3, 1, 1) == pytest.approx(0.3)
    # fixed width: K = W acceptances among W_S drafts
    expected = sum(math.comb(3, k) * 0.6**k * 0.4 ** (3 - k) for k in (2, 3))
    assert layer_pass_probability(0.6, 3, 2) == pytest.approx(expected)
    # dynamic width: K = max{k : P(N >= k) >= t} -> passes with probability >= t
    for alpha in (0.3, 0.6, 0.9):
        got = layer_pass_probability(alpha, 4, 3, threshold=0.7, w_min=1)
        assert got >= 0.7 or got == pytest.approx(1 - (1 - alpha) ** 4)
    assert layer_pass_probability(0.5, 2, 4, threshold=None) == 0.0  # needs more than drafted


def test_rule_extremes_and_monotonicity() -> None:
    assert choose_plan(0.05, 1).gamma == 0  # the embedded pair's regime: do not speculate
    assert choose_plan(0.0, 3, threshold=0.7).gamma == 0
    free = CostModel(draft_pass=0.0, tree_node=0.0)
    assert choose_plan(0.5, 1, cost=free, gamma_max=6).gamma == 6  # free drafting: go deep
    assert choose_plan(0.95, 1).gamma >= 4
    gammas = [choose_plan(a, 1).gamma for a in np.linspace(0.0, 0.99, 60)]
    assert gammas == sorted(gammas)  # more acceptance never shortens the draft
    for alpha in np.linspace(0.0, 1.0, 21):
        for width, threshold in ((1, None), (3, None), (3, 0.7)):
            plan = choose_plan(float(alpha), width, threshold=threshold)
            assert plan.gamma == 0 or plan.speedup >= 1.0
            assert plan.draft_width >= width
    with pytest.raises(ValueError):
        choose_plan(1.5, 1)


def test_running_estimate_and_probing() -> None:
    est = update_estimate(AcceptanceEstimate(alpha=0.5, count=1.0), [0.1, 0.1, 0.1], 1)
    assert est.alpha == pytest.approx((0.5 + 0.3) / 4) and est.layers == 3 and est.passes == 1
    capped = AcceptanceEstimate(alpha=0.0, count=10.0)
    for _ in range(200):
        capped = update_estimate(capped, [1.0], 1, memory=10.0)
    assert capped.alpha > 0.99  # follows drift once the memory is full
    tracker = PairTracker(probe_every=2)
    stats = DecodeStats(layer_alphas=[[0.05, 0.1], [0.08]], accepted_layers=[0, 0])
    tracker.observe("pair", stats)
    assert tracker.plan("pair", 1).gamma == 0
    tracker.observe("pair", DecodeStats())  # a request decoded without the draft
    assert tracker.plan("pair", 1).gamma == 0
    tracker.observe("pair", DecodeStats())
    probe = tracker.plan("pair", 1)
    assert probe.gamma == 1 and probe.draft_width == 1  # re-probe after 2 plain requests
    tracker.observe("pair", DecodeStats(layer_alphas=[[0.05]], accepted_layers=[0]))
    gammas = []
    for _ in range(7):  # the next probe waits twice as long (4 plain requests)
        gammas.append(tracker.plan("pair", 1).gamma)
        tracker.observe("pair", DecodeStats() if gammas[-1] == 0 else stats)
    assert gammas == [0, 0, 0, 0, 1, 0, 0]
    assert tracker.estimate("other").requests == 0  # estimates are per pair


def test_plan_config_keeps_the_request_and_sets_only_speed_knobs() -> None:
    request = SamplingConfig(width=3, threshold=0.7, top_k=20, seed=4, epsilon=0.05)
    method, config = plan_config(Plan(0, 3, 0.0, 1.0, 1.0), request)
    assert method == "beam" and config == request
    assert plan_config(Plan(0, 1, 0.0, 1.0, 1.0), SamplingConfig(width=1))[0] == "sample"
    method, config = plan_config(Plan(2, 6, 0.5, 1.75, 2.0), request)
    assert method == "dsbd" and (config.gamma, config.effective_draft_width) == (2, 6)
    assert config.model_copy(update={"gamma": 3, "draft_width": None}) == request


def test_rejected_layers_have_the_mean_of_the_alpha_compensator_in_the_engine() -> None:
    """Theorem 1's per-position identity through the real engine (SpS, one draft per layer)."""
    rng = np.random.default_rng(3)
    target = np.log(rng.dirichlet(np.ones(5), size=(5, 5)))
    draft = np.log(rng.dirichlet(np.ones(5), size=(5, 5)))
    cfg = SamplingConfig(max_new_tokens=8, gamma=3, seed=2)
    results = generate_batch(
        "sps",
        TableScorer(torch.from_numpy(target)),
        [[1, 2]] * 4000,
        cfg,
        TableScorer(torch.from_numpy(draft)),
    )
    diffs = []
    for r in results:
        st = r.stats
        failed = sum(len(w) for w in st.widths) - sum(st.accepted_layers)
        diffs.append(failed - predicted_rejections(a for layer in st.layer_alphas for a in layer))
    diffs = np.array(diffs)
    assert abs(diffs.mean()) <= 4 * diffs.std(ddof=1) / np.sqrt(len(diffs))
