"""The cost model: per iteration, the draft depth that emits tokens fastest (0: a beam step).

An iteration of depth gamma >= 1 costs one target forward over the W roots' new tokens and the
gamma x W_S forest nodes, gamma draft forwards (the roots' new tokens, then one layer of W_S
nodes each) and the engine's own work, and emits on average E(gamma) = 1 + rho + ... + rho^gamma
tokens per beam, rho being the probability that a drafted layer passes verification (kept per
layer depth, given that the layer above passed: a draft that agrees tends to keep agreeing, so
deeper layers pass more often than the first). gamma = 0 is a plain beam-sampling step: one
target forward over the W roots, one token.

The prices come from a `Calibration`, measured once per machine, models, dtype and device
(`dsbd_core.models.calibrate`, cached on disk): the forwards' costs by the tokens they feed,
scaled at each depth to what whole iterations took when timed (`iteration_timer`: the work
around the forwards grows with the drafted layers, and the sum of the parts misses it) but never
below a beam step plus the target's forward over the forest (a look-up's timed layers were
mostly empty), and the draft's catch-up per beam step it sat out. The choice is a deterministic
function of the calibration and the request's own history: the same seed, settings and machine
decode the same tokens.

The controller picks the depth that saves the most time over the tokens the request may still
emit, less the draft's catch-up (the prompt, before the draft's first run), so speculation is
off wherever the request's pass rates say it would not pay; what a draft that disappoints them
can cost is bounded below. The pass rates are the request's own: Beta priors updated with every
verified layer, older evidence fading by `memory` per iteration. The priors are the pair's pass
rates measured at calibration where the calibration has them (a draft that rarely agrees is not
drafted on hope at the start of every request; a request that drafts one beam, SpS, starts from
the rates measured with one), else the policy's. A request that turned speculation off drafts
one layer after `probe_every` iterations, so that it notices when its draft starts to agree
again; while the probes find it still does not pay, the interval doubles (up to `probe_backoff`
times); and a probe is made only while it costs at most `probe_budget` of the time since the
draft last ran (a large draft's catch-up is dear: the Qwen pair's int8 0.5B draft adds ~10 ms
per step it sat out to a 110 ms beam step on an AMD EPYC, so once it stops paying it is not
probed again). A pair whose measured rates say speculation does not pay starts at the longest
interval.

Per request, the drafted iterations may cost at most `loss_budget` (2 %) of what beam sampling
would take for max_new_tokens beyond the beam steps they stand in for, counted in the same
prices: a depth (or a probe) is drafted only while its worst case, a first layer that fails,
stays within what is left of it (what drafting saved adds to it), or while what the depth is
expected to save over the tokens left is at least `bet_ratio` (2) times what it risks. So
after every drafted iteration a request's loss, in these prices, is at most the larger of its
budget and 1 / bet_ratio of what its last drafted depth was expected to save: the budget alone
bounds only a request that makes no bet (tests/algorithm/test_cost_model.py checks the bound
after every drafted iteration; there a draft that rarely agrees, under a calibration promising
95 %, lost 1.6-2.0 budgets, 3-4 % of a beam decode, with bounds up to 8 budgets); a
draft whose prompt costs more to feed than drafting is expected to save (a large draft on a CPU
whose long forwards are dear, before a long prompt) is not run at all.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.policy.control import Knobs

if TYPE_CHECKING:  # annotations only: the session registry imports this module without torch
    from dsbd_core.algorithm.sequences.state import DecodeState, Outcome


class ForwardCosts(BaseModel):
    """Seconds of one model forward by the number of tokens it feeds."""

    model_config = ConfigDict(frozen=True)

    tokens: list[int] = Field(..., min_length=1, description="Tokens fed, increasing.")
    seconds: list[float] = Field(..., min_length=1)

    def at(self, tokens: float) -> float:
        """Piecewise-linear in the measured points, extended linearly past the last two."""
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1 or tokens <= xs[0]:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class Calibration(BaseModel):
    """What one target/draft pair costs on one machine (dtype, device, threads)."""

    model_config = ConfigDict(frozen=True)

    target: ForwardCosts
    draft: ForwardCosts | None = None
    # The engine's own work per iteration, measured on the decode loop with instant models: a
    # beam step (W x V tables), and what every drafted layer adds.
    engine_step_s: float = Field(0.0, ge=0)
    engine_layer_s: float = Field(0.0, ge=0)
    engine_width: int = Field(1, ge=1, description="The beam width W the engine was timed at.")
    # The pair's pass rate of each drafted layer depth (given the one above passed), measured
    # once on a few chat and code prompts at the default settings (`calibrate.pass_rates`);
    # None: not measured (the policy's priors stand in).
    pass_rates: list[float] | None = None
    # The same for speculative sampling (W = W_S = 1): one drafted token per layer passes more
    # often than a layer of W_S = 3 drafted beams does (their tokens compete for W places);
    # the prior of a request that drafts one beam. None: not measured (`pass_rates` stand in).
    single_pass_rates: list[float] | None = None
    # Seconds of one whole DSBD iteration at each fixed depth 0..G for one session at the
    # default W and W_S (`iteration_width`, `iteration_draft_width`), medians over the pass-rate
    # prompts (`iteration_timer`): the cost model scales its sum-of-parts prices at each depth
    # to what these measured. None: not measured (the parts' sum stands).
    iteration_s: list[float] | None = None
    # Seconds a drafted iteration adds per beam step the draft sat out (it first feeds the
    # beams' new tokens); None: not measured (catching up is then taken to be free).
    catch_up_s: float | None = Field(None, ge=0)
    iteration_width: int = Field(3, ge=1)
    iteration_draft_width: int = Field(3, ge=1)
    description: str = ""

    def engine_seconds(self, width: int, gamma: int) -> float:
        """Engine time of an iteration: its tables grow with W (work per candidate)."""
        scale = width / self.engine_width
        return scale * (self.engine_step_s + gamma * self.engine_layer_s)


class CostPolicy(BaseModel):
    """How the controller treats what it has not measured yet."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prior_first: float = Field(
        0.6, ge=0, le=1, description="Pass rate of a first drafted layer before any is seen."
    )
    prior_next: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Pass rate of a deeper layer given the one above it passed, before any is "
        "seen: layers are not independent (a draft that agrees keeps agreeing).",
    )
    prior_weight: float = Field(2.0, gt=0, description="Layers each prior counts as.")
    memory: float = Field(
        0.85, gt=0, le=1, description="Weight of older evidence per iteration (1: never fades)."
    )
    probe_every: int = Field(
        6,
        ge=1,
        description="Draft >= 1 layer every this many iterations while speculation "
        "is off, to notice a draft that agrees again.",
    )
    probe_backoff: int = Field(
        8,
        ge=1,
        description="While probes keep finding that speculation does not pay, the "
        "interval doubles, up to probe_every x this (1: never backs off).",
    )
    probe_budget: float = Field(
        0.02,
        ge=0,
        le=1,
        description="The most a probe may cost (the draft's catch-up and a drafted layer), "
        "as a share of the time since the draft last ran: a draft whose catch-up is dear "
        "is not probed at all once it stopped paying.",
    )
    loss_budget: float = Field(
        0.02,
        ge=0,
        le=1,
        description="The most the request's drafted iterations may cost beyond the beam steps "
        "they stand in for, as a share of a beam-sampling decode of max_new_tokens: a depth "
        "is drafted only while its worst case (one token emitted) keeps the request within it, "
        "or while bet_ratio says the bet is worth its risk.",
    )
    bet_ratio: float = Field(
        2.0,
        gt=0,
        description="A depth beyond the loss budget is still drafted when what it is expected "
        "to save over the tokens left is at least this many times what it risks (its worst "
        "case plus what the request lost so far). Twice: the expected saving comes from the "
        "pair's pass rates, an average over chat and code prompts that one request's own "
        "rate may fall far short of.",
    )


def expected_tokens(pass_rates: list[float], gamma: int) -> float:
    """1 + r1 + r1 r2 + ... : tokens per beam an iteration of depth gamma emits, r_k being the
    probability that layer k passes given that layer k - 1 did."""
    total, reach = 1.0, 1.0
    for rate in pass_rates[:gamma]:
        reach *= rate
        total += reach
    return total


class _Rate:
    """Pass counts of one layer depth, older evidence fading."""

    def __init__(self, prior: float, weight: float) -> None:
        self.prior, self.weight = prior, weight
        self.passed, self.tried = prior * weight, weight

    def add(self, passed: float, tried: float, memory: float) -> None:
        self.passed = memory * self.passed + (1 - memory) * self.prior * self.weight + passed
        self.tried = memory * self.tried + (1 - memory) * self.weight + tried

    @property
    def rate(self) -> float:
        return self.passed / self.tried


def layer_passes(
    state: DecodeState, outcome: Outcome, depths: int
) -> list[tuple[float, float]] | None:
    """(passed, tried) of each drafted layer depth 1..`depths` in one iteration, over its live
    sessions: layer k + 1 is tried where it was drafted and layer k passed. None when nothing
    was drafted."""
    if state.depth is None or state.live is None or not bool(state.live.any()):
        return None
    depth = state.depth[state.live]
    if not bool((depth > 0).any()):
        return None
    accepted = outcome.record["accepted_layers"][state.live]
    counts = []
    for k in range(depths):
        tried = (depth > k) & (accepted >= k)
        passed = tried & (accepted > k)
        counts.append((float(passed.sum()), float(tried.sum())))
    return counts


class CostController:
    """Chooses each iteration's gamma (0 = a plain beam step) to maximise tokens per second.

    The draft width W_S is the request's (`effective_draft_width`); gamma is at most the
    request's. Pass rates are kept per layer depth, conditional on the layer above passing.
    A `Controller` (`control.py`): the decode loop asks `knobs` before every iteration and
    calls `observe` with its outcome.
    """

    def __init__(
        self,
        config: SamplingConfig,
        calibration: Calibration,
        policy: CostPolicy | None = None,
    ) -> None:
        self.config = config
        self.calibration = calibration
        self.policy = policy or CostPolicy()
        # a drafting decode's controller (its callers build none for a method without a draft)
        self.gamma_max = config.gamma if calibration.draft is not None else 0
        self.draft_width = config.effective_draft_width
        # an iteration's price at each depth 0..gamma: fixed by the calibration and the request
        self.prices = [self._price(gamma) for gamma in range(config.gamma + 1)]
        self.rates = [_Rate(prior, self.policy.prior_weight) for prior in self.priors()]
        self.since_draft = 0  # iterations since the last one that drafted
        self.drafted = False  # whether the draft has run (fed the prompt) yet
        # predicted seconds the drafted iterations cost beyond the beam steps that would have
        # emitted their tokens (negative: saved); the catch-up of the pending iteration
        self.loss = 0.0
        self._pending_lag = 0.0
        self._prompt_tokens: float | None = None
        # probes that found speculation still not paying double the interval to the next (a
        # probe costs a draft pass, the draft's catch-up and a forest verify: with a draft that
        # never agrees, probing every 6 iterations cost the embedded pair ~15 % of its time,
        # 6 % with its measured pass rates as priors); a pair measured not to pay starts at the
        # longest interval, and a probe that finds agreement resets it
        self.probe_interval = self.policy.probe_every
        if calibration.pass_rates and self.gamma_max > 0 and self.best_gamma() == 0:
            self.probe_interval = self.policy.probe_every * self.policy.probe_backoff
        self.chosen: list[int] = []  # gamma of every iteration (reported with the stats)

    def priors(self) -> list[float]:
        """The pass rate of each layer depth before the request's own evidence: the pair's
        measured rates (the deepest measured one stands for deeper layers), else the policy's."""
        measured, p = self.calibration.pass_rates, self.policy
        one_beam = self.config.width == 1 and self.draft_width == 1
        if one_beam and self.calibration.single_pass_rates:
            measured = self.calibration.single_pass_rates
        if measured:
            return [measured[min(k, len(measured) - 1)] for k in range(self.gamma_max)]
        return [p.prior_first if k == 0 else p.prior_next for k in range(self.gamma_max)]

    def knobs(self, state: DecodeState) -> Knobs:
        lag = self.catch_up_seconds(state)
        gamma = self.best_gamma(state, lag)
        if gamma > 0:
            self.probe_interval = self.policy.probe_every
        elif self.gamma_max > 0 and self.since_draft + 1 >= self.probe_interval:
            cheap = self.probe_seconds(lag) <= self.policy.probe_budget * self.idle_seconds()
            if cheap and self.affordable(1, lag):
                gamma = 1
            longest = self.policy.probe_every * self.policy.probe_backoff
            self.probe_interval = min(2 * self.probe_interval, longest)
        if gamma > 0:
            self._pending_lag = lag
            self.drafted = True
        self.chosen.append(gamma)
        return Knobs(gamma=gamma, draft_width=self.draft_width)

    def affordable(self, gamma: int, lag: float, saving: float = 0.0) -> bool:
        """Whether an iteration of depth gamma keeps the request within `loss_budget` even if
        its first layer fails (it then emits the one token a beam step would, at its own price
        and the draft's catch-up `lag`), or is a bet worth its risk: `saving`, what drafting at this
        depth is expected to save over the tokens left, at least `bet_ratio` times the loss it
        risks. Savings of earlier drafted iterations count towards both, so a draft that pays
        may keep drafting; one that lost its share is not drafted again."""
        risk = self.loss + self.iteration_seconds(gamma) + lag - self.iteration_seconds(0)
        return risk <= self.loss_budget_seconds() or saving >= self.policy.bet_ratio * risk

    def loss_budget_seconds(self) -> float:
        """`loss_budget` of what beam sampling takes for the request's max_new_tokens."""
        return self.policy.loss_budget * self.iteration_seconds(0) * self.config.max_new_tokens

    def observe(self, state: DecodeState, outcome: Outcome, knobs: Knobs) -> None:
        if state.live is None or not bool(state.live.any()):
            return
        counts = layer_passes(state, outcome, len(self.rates)) if knobs.gamma > 0 else None
        if counts is None:
            self.since_draft += 1
            return
        self.since_draft = 0
        # tokens per beam: one, and one more for every layer that passed (mean over sessions)
        emitted = 1.0 + sum(passed for passed, _ in counts) / max(counts[0][1], 1.0)
        self.loss += self.iteration_seconds(knobs.gamma) + self._pending_lag
        self.loss -= emitted * self.iteration_seconds(0)
        for rate, (passed, tried) in zip(self.rates, counts, strict=True):
            rate.add(passed, tried, self.policy.memory)

    @property
    def pass_rates(self) -> list[float]:
        return [rate.rate for rate in self.rates]

    def best_gamma(self, state: DecodeState | None = None, lag: float | None = None) -> int:
        """The depth that saves the most time over the rest of the decode: per token, a beam
        step's seconds less depth gamma's seconds per expected token, times the tokens left,
        less what the draft's catch-up costs first (ties: the shallower), among the depths the
        request's loss budget affords. With the draft caught up and the budget untouched that
        is the depth with the most tokens per second. `lag`: the catch-up, where the caller
        already has it."""
        lag = self.catch_up_seconds(state) if lag is None else lag
        rates = self.pass_rates
        per_token = [
            self.iteration_seconds(g) / expected_tokens(rates, g) for g in range(self.gamma_max + 1)
        ]
        left = self.tokens_left() if lag > 0 else 1.0
        best, best_saving = 0, 0.0
        for gamma in range(1, self.gamma_max + 1):
            saving = (per_token[0] - per_token[gamma]) * left - lag
            better = saving > best_saving + 1e-9 * per_token[0]
            if better and self.affordable(gamma, lag, saving):
                best, best_saving = gamma, saving
        return best

    def tokens_left(self) -> float:
        """At most the tokens the decode may still emit: every iteration emitted at least one
        (counted here, so that no device value is read)."""
        return max(self.config.max_new_tokens - len(self.chosen), 1.0)

    def catch_up_seconds(self, state: DecodeState | None) -> float:
        """What the draft's catch-up adds to the next drafted iteration: per beam step it sat
        out, or, before its first run, the prompt's tokens (fed once for all W beams)."""
        per_step = self.calibration.catch_up_s
        if not per_step:
            return 0.0
        per_step *= self.config.width / self.calibration.iteration_width  # W rows each step
        if self.drafted:
            return per_step * self.since_draft
        if state is None:
            return 0.0
        if self._prompt_tokens is None:  # read once
            self._prompt_tokens = float(state.prompt_len.max())
        return per_step * self._prompt_tokens / self.config.width

    def probe_seconds(self, lag: float) -> float:
        """A probe's cost over a beam step: the draft's catch-up `lag` and one drafted layer."""
        return lag + self.iteration_seconds(1) - self.iteration_seconds(0)

    def idle_seconds(self) -> float:
        """The beam steps run since the draft last ran, in seconds."""
        return self.since_draft * self.iteration_seconds(0)

    def iteration_seconds(self, gamma: int) -> float:
        """Predicted seconds of an iteration of depth gamma (0..the request's gamma)."""
        return self.prices[gamma]

    def _price(self, gamma: int) -> float:
        """The sum of an iteration's parts, scaled by what whole iterations timed at calibration
        took at that depth (the measured seconds themselves at the widths they were timed at),
        and never below a beam step's price plus what the target's forward over the forest's
        nodes adds: an iteration that drafts does a beam step's work and more. The floor binds
        where the timed iterations had emptier forests than the price assumes: the prompt
        look-up drafts only where its context repeats, so on the calibration's prompts its
        timed layers were mostly empty, and the scaled sum priced a drafted SpS iteration below
        a plain step (an AMD EPYC without AVX-512, the embedded pair in float32: 66 ms at depth 2
        against 88 ms at depth 0), so SpS drafted every iteration and ran 1.21x sampling's time."""
        width, draft_width = self.config.width, self.draft_width
        price = self.parts_seconds(gamma, width, draft_width) * self.scale(gamma)
        if gamma == 0:
            return price
        step = self._price(0)
        target = self.calibration.target
        return max(price, step + target.at(width + gamma * draft_width) - target.at(width))

    def parts_seconds(self, gamma: int, width: int, draft_width: int) -> float:
        """The sum of an iteration's parts: the target's forward over W + gamma x W_S tokens,
        the engine's work and the draft's gamma forwards."""
        cal = self.calibration
        seconds = cal.target.at(width + gamma * draft_width)
        seconds += cal.engine_seconds(width, gamma)
        if gamma > 0 and cal.draft is not None:
            seconds += cal.draft.at(width) + (gamma - 1) * cal.draft.at(draft_width)
        return seconds

    def scale(self, gamma: int) -> float:
        """Measured over summed seconds of depth gamma at the widths the whole iterations were
        timed at (1 where they were not; the deepest timed depth stands for deeper ones)."""
        cal = self.calibration
        measured = cal.iteration_s
        if not measured:
            return 1.0
        depth = min(gamma, len(measured) - 1)
        parts = self.parts_seconds(depth, cal.iteration_width, cal.iteration_draft_width)
        return measured[depth] / parts

    def tokens_per_second(self, gamma: int) -> float:
        return expected_tokens(self.pass_rates, gamma) / self.iteration_seconds(gamma)
