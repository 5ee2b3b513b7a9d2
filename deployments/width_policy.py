"""The width controller's policy: per request and iteration, how deep and how wide to draft.

Knobs split in two kinds:

* **Distribution-defining** — the beam width `W`, the width threshold `t` and `w_min` (dynamic
  width), temperature, top-k/p, mode. They decide which distribution the output follows, so the
  controller passes the request's values through unchanged.
* **Speed-only** — the draft depth `gamma` and the draft width `W_S`. Fixed-width DSBD is exact
  for every depth and draft width (docs/ALGORITHM.md), so these are free to adapt within the
  request's limits (`gamma`, `draft_width` of the request are maxima).

Depth rule. With `rho` the measured probability that a drafted layer passes verification (an
exponentially weighted mean over the session's iterations, started from the replica-wide mean),
an iteration of depth `g` emits on average `E(g) = 1 + rho + ... + rho^g` tokens and costs
`1 + g * (c_draft + c_verify)` target-step equivalents: `c_draft` is one draft forward relative to
one target forward, `c_verify` what one more forest layer adds to the target forward. That last
term is what load changes: with few requests the target forward is memory-bound and extra layers
ride along nearly free; once the verifier's batches are full (`load >= capacity` concurrent
sessions) every layer costs like a step. So `c_verify = verify_layer_cost * min(1, load /
capacity)`. The controller picks `g in [0, gamma_max]` maximising `E(g) / cost(g)`; `g = 0` turns
speculation off for the iteration (a plain beam-sampling step). Every `probe_every`-th iteration
drafts at least one layer, so a session whose acceptance recovers is noticed.

Draft width rule. `W_S` stays at the request's value while the verifier has room; past
capacity it is halved (fewer forest nodes per layer), never below 1.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dsbd_core.algorithm.control import Knobs


class PolicyConfig(BaseModel):
    """Constants of the policy (set from measurements of the deployed pair)."""

    model_config = ConfigDict(extra="forbid")

    draft_cost: float = Field(0.35, ge=0, description="Draft forward / target forward time.")
    verify_layer_cost: float = Field(0.5, ge=0, description="Target cost of a layer at capacity.")
    capacity: int = Field(8, ge=1, description="Sessions a verifier batch serves at no extra cost.")
    prior_pass_rate: float = Field(0.5, ge=0, le=1, description="rho before anything is seen.")
    smoothing: float = Field(0.3, gt=0, le=1, description="Weight of the newest iteration in rho.")
    probe_every: int = Field(8, ge=1, description="Draft >= 1 layer every this many iterations.")


def expected_tokens(rho: float, gamma: int) -> float:
    """1 + rho + ... + rho^gamma: tokens an iteration of depth gamma emits on average."""
    return sum(rho**i for i in range(gamma + 1))


def choose_knobs(
    rho: float, gamma_max: int, draft_width_max: int, load: int, iteration: int,
    policy: PolicyConfig,
) -> Knobs:  # fmt: skip
    """The depth maximising tokens per cost, and the draft width for the current load."""
    pressure = min(1.0, load / policy.capacity)
    per_layer = policy.draft_cost + policy.verify_layer_cost * pressure
    best, best_value = 0, 0.0
    for gamma in range(gamma_max + 1):
        value = expected_tokens(rho, gamma) / (1.0 + gamma * per_layer)
        if value > best_value + 1e-12:
            best, best_value = gamma, value
    if best == 0 and gamma_max > 0 and iteration % policy.probe_every == 0:
        best = 1
    width = draft_width_max if load <= policy.capacity else max(1, draft_width_max // 2)
    return Knobs(gamma=best, draft_width=width)


def layer_pass_rate(accepted_layers: int, depth: int) -> float | None:
    """This iteration's fraction of attempted layers that passed (None if none was drafted).

    Layers after the first failure are never verified, so the attempts are accepted + 1 unless
    all `depth` layers passed.
    """
    if depth <= 0:
        return None
    attempted = min(depth, accepted_layers + 1)
    return accepted_layers / attempted
