"""Online acceptance predictor and the rule that picks `gamma` and the draft width (THEORY.md §9.3).

Why: whether speculation pays depends on how often the target accepts the draft, which depends
on the model pair (and drifts with the prompt). Every verified layer already computes both
distributions, so its first-draft acceptance probability `α_1 = Σ_x min(P_l, Q_l) = 1 - TV`
is free (the engine records it in `DecodeStats.layer_alphas`). Theorem 1 says that for one
draft per layer the probability the layer is rejected, given the prefix, is exactly `1 - α_1`,
so `Σ (1 - α_1)` over the verified layers is an unbiased, low-variance predictor of the
rejections of the request (a compensator; THEORY.md §8.2, P5), and a running mean of `α_1` per
model pair predicts the next requests.

The rule (`choose_plan`, a pure function the width-controller deployment calls per request):
for each draft depth γ in 1..gamma_max and draft width W_S in a small grid, predict

* the per-layer pass probability `a = P(N ≥ K)`, N = acceptances among W_S drafts modelled as
  Binomial(W_S, α) (independent drafts, acceptance α each — exact for W_S = 1; for W_S > 1 an
  approximation of the residual chain), K = the beam width W for fixed width, or DSBD's
  threshold rule `max{k : P(N ≥ k) ≥ t}` clamped to [w_min, W] for dynamic width;
* tokens per iteration `Σ_{k=0}^{γ} a^k` (k passed layers, then a fallback or bonus token);
* the iteration's cost in plain target steps, `CostModel.iteration(γ, W_S, W)`;

and take the (γ, W_S) with the most predicted tokens per unit cost. If that is not above
`min_speedup` (plain target decoding makes 1 token per unit cost) the plan is γ = 0: decode
without the draft. The beam width W itself is never changed — it is part of what the user asked
to sample (beam sampling of width W); γ and W_S are pure speed knobs (fixed-width DSBD is exact
for every γ and W_S). Since a γ = 0 request observes nothing, `PairTracker` re-probes with γ = 1
after `probe_every` such requests so the estimate can recover if the pair's acceptance changes,
backing off (4, 8, 16, ... 64 requests) while the probes confirm that speculation does not pay.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dsbd_core.algorithm.config import SamplingConfig


@dataclass(frozen=True)
class CostModel:
    """Cost of one DSBD iteration in units of one plain target step on the same beams.

    Defaults were measured on the project's 2-core CPU with the SmolLM2 pair (a 2-layer draft of
    the 30-layer target: one draft forward ≈ 0.25 target forwards; each verified forest node adds
    ≈ 0.1 of a target step — see benchmarks/results/methods_smollm2.json, in git history at
    f92e4ee, and benchmarks/investigations/draft_depth/results/draft_depth.json).
    On a GPU tree nodes are nearly free (tree_node ≈ 0); measure and pass your own.
    """

    draft_pass: float = 0.25
    tree_node: float = 0.1

    def iteration(self, gamma: int, draft_width: int, width: int) -> float:
        """`1 + γ (draft_pass · W_S / W + tree_node · W_S)`; 1 for plain decoding (γ = 0)."""
        if gamma == 0:
            return 1.0
        per_layer = self.draft_pass * draft_width / max(width, 1) + self.tree_node * draft_width
        return 1.0 + gamma * per_layer


@dataclass(frozen=True)
class Plan:
    """What the rule chose and what it predicts. gamma = 0 means: do not speculate."""

    gamma: int
    draft_width: int
    pass_probability: float
    tokens_per_iteration: float
    cost_per_iteration: float

    @property
    def speedup(self) -> float:
        """Predicted tokens per unit cost relative to plain target decoding (= 1)."""
        return self.tokens_per_iteration / self.cost_per_iteration

    @property
    def accepted_length(self) -> float:
        """Predicted mean number of passed draft layers per iteration."""
        return self.tokens_per_iteration - 1.0

    @property
    def target_passes_per_token(self) -> float:
        """Predicted target forwards per emitted token (ratio of expectations)."""
        return 1.0 / self.tokens_per_iteration


# ----------------------------------------------------------------------------------- prediction
def predicted_rejections(layer_alphas: Iterable[float]) -> float:
    """`Σ (1 - α_1)` over verified layers: for one draft per layer, the expected number of
    rejected layers given the verified prefixes (Theorem 1's per-position identity)."""
    return float(sum(1.0 - a for a in layer_alphas))


def tokens_per_iteration(pass_probability: float | Sequence[float], gamma: int) -> float:
    """`Σ_{k=0}^{γ} Π_{j≤k} a_j`: emitted tokens per iteration when layer j passes with
    probability a_j (a scalar a means the same for every layer). Independence across layers is
    assumed (Leviathan et al.); Theorem 1 needs no such assumption but also gives no γ rule."""
    a = np.broadcast_to(np.asarray(pass_probability, dtype=np.float64), (gamma,))
    return float(1.0 + np.cumprod(a).sum()) if gamma > 0 else 1.0


def expected_accepted_length(pass_probability: float | Sequence[float], gamma: int) -> float:
    """Mean number of passed draft layers per iteration, `Σ_{k=1}^{γ} Π_{j≤k} a_j`."""
    return tokens_per_iteration(pass_probability, gamma) - 1.0


def acceptance_count_pmf(alpha: float, draft_width: int) -> np.ndarray:
    """`P(N = k)`, k = 0..W_S, with N ~ Binomial(W_S, α) (the model of the rule, above)."""
    k = np.arange(draft_width + 1)
    coeff = np.array([math.comb(draft_width, int(i)) for i in k], dtype=np.float64)
    return coeff * alpha**k * (1.0 - alpha) ** (draft_width - k)


def layer_pass_probability(
    alpha: float, draft_width: int, width: int, threshold: float | None = None, w_min: int = 1
) -> float:
    """Predicted probability that a verified layer gets the K acceptances it needs.

    Fixed width (`threshold=None`): K = W. Dynamic width: DSBD's rule K = max{k : P(N≥k) ≥ t}
    clamped to [w_min, W], evaluated on the same Binomial model
    (dsbd_core/algorithm/iteration/width.py
    does it on the exact residual chain)."""
    tail = np.cumsum(acceptance_count_pmf(alpha, draft_width)[::-1])[::-1]  # P(N >= k)
    tail = np.append(tail, 0.0)  # P(N >= W_S + 1) = 0
    if threshold is None:
        needed = width
    else:
        meets = np.nonzero(tail >= threshold - 1e-12)[0]
        needed = min(max(int(meets.max()) if meets.size else 0, w_min), width)
    return float(tail[min(needed, draft_width + 1)])


# ----------------------------------------------------------------------------------- the rule
def default_draft_widths(width: int) -> tuple[int, ...]:
    """Draft widths the rule considers: W, W + 1, 2W, 3W (capped at the config limit 64)."""
    return tuple(sorted({min(w, 64) for w in (width, width + 1, 2 * width, 3 * width)}))


def choose_plan(
    alpha: float,
    width: int,
    cost: CostModel = CostModel(),
    threshold: float | None = None,
    w_min: int = 1,
    gamma_max: int = 8,
    draft_widths: Sequence[int] | None = None,
    min_speedup: float = 1.0,
) -> Plan:
    """The (γ, W_S) with the most predicted tokens per unit cost, or γ = 0 (see module doc).

    alpha: predicted first-draft acceptance `α_1` of a layer (e.g. `AcceptanceEstimate.alpha`);
    width: the request's beam width W; threshold / w_min: its width rule (None = fixed width).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: allowed 0 <= alpha <= 1")
    best = Plan(0, width, 0.0, 1.0, 1.0)
    for draft_width in draft_widths or default_draft_widths(width):
        a = layer_pass_probability(alpha, draft_width, width, threshold, w_min)
        for gamma in range(1, gamma_max + 1):
            plan = Plan(
                gamma,
                draft_width,
                a,
                tokens_per_iteration(a, gamma),
                cost.iteration(gamma, draft_width, width),
            )
            if plan.speedup > best.speedup + 1e-12:
                best = plan
    if best.gamma > 0 and best.speedup < min_speedup:
        return Plan(0, width, best.pass_probability, 1.0, 1.0)
    return best


# ----------------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class AcceptanceEstimate:
    """Running estimate of a model pair's first-draft acceptance `α_1` per verified layer.

    `alpha` starts at a prior with weight `count`; each observed layer enters a running mean
    whose weight is capped at `memory` layers (after that an exponential moving average, so the
    estimate follows drift). `layers` / `passes` count raw layer outcomes (for calibration
    reports); `since_probe` counts requests decoded without the draft since the last
    speculative one.
    """

    alpha: float = 0.5
    count: float = 1.0
    layers: int = 0
    passes: int = 0
    requests: int = 0
    since_probe: int = 0

    @property
    def pass_rate(self) -> float | None:
        """Observed fraction of verified layers that passed (None before any)."""
        return self.passes / self.layers if self.layers else None


def update_estimate(
    estimate: AcceptanceEstimate,
    layer_alphas: Sequence[float],
    passed_layers: int = 0,
    memory: float = 256.0,
) -> AcceptanceEstimate:
    """The estimate after one request that verified `len(layer_alphas)` layers (pure)."""
    alpha, count = estimate.alpha, estimate.count
    for a in layer_alphas:
        count = min(count + 1.0, memory)
        alpha += (float(a) - alpha) / count
    speculated = len(layer_alphas) > 0
    return replace(
        estimate,
        alpha=alpha,
        count=count,
        layers=estimate.layers + len(layer_alphas),
        passes=estimate.passes + passed_layers,
        requests=estimate.requests + 1,
        since_probe=0 if speculated else estimate.since_probe + 1,
    )


class PairTracker:
    """Per-model-pair estimates, as the width-controller deployment would keep them.

    Keys are any hashable, e.g. `(target_name, draft_name, width)` (α_1 of a W-beam layer is
    measured on the joint beams x tokens table, so different widths are best kept apart).
    Probing backs off: after a probe the next one waits twice as long (up to `max_probe_every`
    requests); a plan that speculates on its own merits resets the interval to `probe_every`.
    """

    def __init__(
        self,
        prior: AcceptanceEstimate = AcceptanceEstimate(),
        probe_every: int = 4,
        memory: float = 256.0,
        max_probe_every: int = 64,
    ) -> None:
        self.prior, self.probe_every, self.memory = prior, probe_every, memory
        self.max_probe_every = max_probe_every
        self._estimates: dict[Hashable, AcceptanceEstimate] = {}
        self._intervals: dict[Hashable, int] = {}

    def estimate(self, pair: Hashable) -> AcceptanceEstimate:
        return self._estimates.get(pair, self.prior)

    def observe(self, pair: Hashable, stats: object) -> AcceptanceEstimate:
        """Fold one request's `DecodeStats` (layer_alphas, accepted_layers) into the estimate."""
        alphas = [a for layer in getattr(stats, "layer_alphas", []) for a in layer]
        passed = int(sum(getattr(stats, "accepted_layers", [])))
        updated = update_estimate(self.estimate(pair), alphas, passed, self.memory)
        self._estimates[pair] = updated
        return updated

    def plan(
        self,
        pair: Hashable,
        width: int,
        cost: CostModel = CostModel(),
        threshold: float | None = None,
        w_min: int = 1,
        gamma_max: int = 8,
    ) -> Plan:
        """`choose_plan` on the pair's estimate; a γ = 0 plan becomes a γ = 1 probe at width W
        once the current probe interval of requests in a row decoded without speculation."""
        estimate = self.estimate(pair)
        plan = choose_plan(estimate.alpha, width, cost, threshold, w_min, gamma_max)
        interval = self._intervals.get(pair, self.probe_every)
        if plan.gamma > 0:
            self._intervals[pair] = self.probe_every
        elif estimate.since_probe >= interval:
            a = layer_pass_probability(estimate.alpha, width, width, threshold, w_min)
            plan = Plan(1, width, a, tokens_per_iteration(a, 1), cost.iteration(1, width, width))
            self._intervals[pair] = min(2 * interval, self.max_probe_every)
        return plan


def plan_config(plan: Plan, config: SamplingConfig) -> tuple[str, SamplingConfig]:
    """The decoder method and config that run `plan` for a request asking for `config`.

    γ = 0: target-only decoding with the same width (`sample` for W = 1, `beam` otherwise), the
    exact law DSBD with fixed width also has. Otherwise DSBD with the plan's γ and W_S; every
    other field (width, threshold, filters, seed, ε) is the request's own.
    """
    if plan.gamma == 0:
        return ("sample" if config.width == 1 else "beam"), config
    update = {"gamma": plan.gamma, "draft_width": plan.draft_width}
    return "dsbd", config.model_copy(update=update)
