"""The cost model: per iteration, the draft depth (and draft width) that emits tokens fastest.

An iteration of depth gamma costs one target forward over the roots' new tokens and the forest
(W_S nodes per layer), gamma draft forwards and the engine's own work, and emits on average
E(gamma) = 1 + rho + ... + rho^gamma tokens per beam, rho being the probability that a drafted
layer passes verification. gamma = 0 is a plain beam-sampling step (one target forward over the
W beams' last tokens). The controller picks the (gamma, W_S) with the most tokens per second
and so turns speculation off wherever it would not pay: DSBD is then never much slower than
beam sampling, whatever the draft.

Costs come from a `Calibration`: forward times measured once per machine, models, dtype and
device (`dsbd_core.models.calibrate`, cached on disk), so the choice is a deterministic function
of the calibration and the request's own history: the same seed, settings and machine decode the
same tokens. rho is estimated from the request's own iterations (a Beta prior, `prior_pass_rate`
with weight `prior_weight`, updated with every verified layer), separately per draft width.
"""

from __future__ import annotations

import bisect

from pydantic import BaseModel, ConfigDict, Field

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.control import Knobs
from dsbd_core.algorithm.state import DecodeState, Outcome


class ForwardCosts(BaseModel):
    """Seconds of one model forward by the number of tokens it feeds (one cached row)."""

    model_config = ConfigDict(frozen=True)

    tokens: list[int] = Field(..., min_length=1, description="Tokens fed, increasing.")
    seconds: list[float] = Field(..., min_length=1)

    def at(self, tokens: float) -> float:
        """Piecewise-linear in the measured points, extended linearly past the last one."""
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1 or tokens <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class Calibration(BaseModel):
    """What one target/draft pair costs on this machine (dtype, device, threads)."""

    model_config = ConfigDict(frozen=True)

    target: ForwardCosts
    draft: ForwardCosts | None = None
    # The engine's own work per iteration: fixed, and per drafted layer per candidate of the
    # layer's table (vocabulary x parent beams): sampling, filtering, verification, width rule.
    engine_fixed_s: float = Field(0.0, ge=0)
    engine_per_candidate_s: float = Field(0.0, ge=0)
    vocab_size: int = Field(1, ge=1)
    description: str = ""


class CostPolicy(BaseModel):
    """How the controller treats what it has not measured yet."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prior_pass_rate: float = Field(0.5, ge=0, le=1, description="rho before any layer is seen.")
    prior_weight: float = Field(2.0, gt=0, description="Layers the prior counts as.")
    memory: float = Field(
        0.9, gt=0, le=1, description="Weight of older evidence per iteration (1: no forgetting)."
    )
    probe_every: int = Field(
        8, ge=1, description="Draft at least one layer every this many iterations, so that a "
        "request that turned speculation off notices when its draft starts to agree again.",
    )  # fmt: skip
    draft_widths: str = Field(
        "request", pattern="^(request|adapt)$",
        description="request: W_S as the request sets it; adapt: also try 2 W_S and W_S // 2.",
    )  # fmt: skip


class _PassRate:
    """Exponentially forgotten pass counts of verified layers (one draft width)."""

    def __init__(self, policy: CostPolicy) -> None:
        self.policy = policy
        self.passed = policy.prior_pass_rate * policy.prior_weight
        self.tried = policy.prior_weight

    def add(self, passed: int, tried: int) -> None:
        keep = self.policy.memory
        prior = self.policy.prior_pass_rate * self.policy.prior_weight
        self.passed = keep * self.passed + (1 - keep) * prior + passed
        self.tried = keep * self.tried + (1 - keep) * self.policy.prior_weight + tried

    @property
    def rate(self) -> float:
        return self.passed / self.tried


def expected_tokens(rho: float, gamma: int) -> float:
    """1 + rho + ... + rho^gamma: tokens per beam an iteration of depth gamma emits."""
    return sum(rho**i for i in range(gamma + 1))


class CostController:
    """Chooses gamma (0 = a plain beam step) and W_S per iteration to maximise tokens/second."""

    def __init__(
        self,
        config: SamplingConfig,
        calibration: Calibration,
        policy: CostPolicy | None = None,
        *,
        uses_draft: bool = True,
    ) -> None:
        self.config = config
        self.calibration = calibration
        self.policy = policy or CostPolicy()
        self.uses_draft = uses_draft and calibration.draft is not None
        self.gamma_max = config.gamma if self.uses_draft else 0
        self.widths = self._draft_widths()
        self.rates = {w: _PassRate(self.policy) for w in self.widths}
        self.iterations = 0
        self.last_emitted = 1.0  # tokens per beam the last iteration emitted (root tails)
        self.choices: list[tuple[int, int]] = []

    def knobs(self, state: DecodeState) -> Knobs:
        best = (0, self.widths[0])
        if self.gamma_max > 0:
            best_rate = self.tokens_per_second(0, self.widths[0])
            for width in self.widths:
                for gamma in range(1, self.gamma_max + 1):
                    rate = self.tokens_per_second(gamma, width)
                    if rate > best_rate * (1 + 1e-9):
                        best, best_rate = (gamma, width), rate
            if best[0] == 0 and self.iterations % self.policy.probe_every == 0:
                best = (1, self.widths[0])
        self.choices.append(best)
        return Knobs(gamma=best[0], draft_width=best[1])

    def observe(self, state: DecodeState, outcome: Outcome, knobs: Knobs) -> None:
        self.iterations += 1
        live = state.live if state.live is not None else state.alive.any(dim=1)
        if state.depth is None or not bool(live.any()):
            return
        rows = live.nonzero()[:, 0]
        emitted = outcome.emitted[rows].double().mean()
        self.last_emitted = float(emitted)
        if knobs.gamma == 0 or knobs.draft_width not in self.rates:
            return
        accepted = outcome.record["accepted_layers"][rows]
        depth = state.depth[rows]
        tried = int(torch_minimum(depth, accepted + 1).sum())
        self.rates[knobs.draft_width].add(int(accepted.sum()), tried)

    # ------------------------------------------------------------------ the model
    def iteration_seconds(self, gamma: int, draft_width: int) -> float:
        """Predicted seconds of an iteration of depth gamma with W_S = draft_width."""
        cal, width = self.calibration, self.config.width
        tails = width * max(self.last_emitted, 1.0)  # the roots' new tokens, fed by both models
        seconds = cal.target.at(tails + gamma * draft_width)
        seconds += cal.engine_fixed_s
        if gamma > 0 and cal.draft is not None:
            seconds += cal.draft.at(tails) + (gamma - 1) * cal.draft.at(draft_width)
            candidates = cal.vocab_size * (width + draft_width)
            seconds += gamma * candidates * cal.engine_per_candidate_s
        else:
            seconds += cal.vocab_size * width * cal.engine_per_candidate_s
        return seconds

    def tokens_per_second(self, gamma: int, draft_width: int) -> float:
        rho = self.rates[draft_width].rate if gamma > 0 else 0.0
        return expected_tokens(rho, gamma) / self.iteration_seconds(gamma, draft_width)

    def _draft_widths(self) -> list[int]:
        asked = self.config.effective_draft_width
        if self.policy.draft_widths == "request":
            return [asked]
        return sorted({asked, max(1, asked // 2), 2 * asked})


def torch_minimum(a, b):  # noqa: ANN001, ANN201 - tensors
    """Elementwise minimum (kept here so this module reads without a torch import above)."""
    import torch

    return torch.minimum(a, b)
