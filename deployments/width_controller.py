"""The width controller deployment: owns each request's speed knobs, sees the load.

The router opens a session with the request's limits, reports every iteration's outcome
(accepted layers out of the drafted depth) and asks for the next iteration's knobs; the policy
is `deployments.width_policy` (documented there). Load is the number of open sessions across
all router replicas. The per-layer width DP of dynamic-width DSBD stays in the verifier: it
needs the target's distributions, which only the verifier has.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ray import serve

from deployments.width_policy import PolicyConfig, choose_knobs, layer_pass_rate
from dsbd_core.algorithm.control import Knobs


@dataclass
class _SessionKnobs:
    limits: Knobs
    rho: float
    iterations: int
    adaptive: bool
    seen: float


@serve.deployment(
    name="WidthController", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
)
class WidthController:
    """One replica: it is a small dict of sessions and a few arithmetic operations per call."""

    def __init__(self, policy: dict[str, Any] | None = None, session_ttl_s: float = 600.0) -> None:
        self.policy = PolicyConfig.model_validate(policy or {})
        self.session_ttl_s = session_ttl_s
        self._sessions: dict[str, _SessionKnobs] = {}
        self._closed: dict[str, float] = {}  # session -> when closed (see `close`)
        self._rho = self.policy.prior_pass_rate  # replica-wide mean, the prior of new sessions

    async def open(self, session: str, limits: Knobs, adaptive: bool = True) -> Knobs:
        """Register a request; returns its first iteration's knobs."""
        self._expire()
        state = _SessionKnobs(limits, self._rho, 0, adaptive, time.monotonic())
        if session not in self._closed:  # else: a late open of a request that has ended
            self._sessions[session] = state
        return self._knobs(state)

    async def plan(self, session: str, accepted_layers: int, depth: int) -> Knobs:
        """Record one iteration of `session`; returns the knobs of its next iteration."""
        state = self._sessions.get(session)
        if state is None:  # expired or opened on a controller that restarted
            raise KeyError(f"session {session!r} is not open")
        state.seen = time.monotonic()
        state.iterations += 1
        rate = layer_pass_rate(accepted_layers, depth)
        if rate is not None:
            w = self.policy.smoothing
            state.rho = (1 - w) * state.rho + w * rate
            self._rho = (1 - w / 4) * self._rho + (w / 4) * rate
        return self._knobs(state)

    async def close(self, session: str) -> None:
        """The request ended (finished, failed or cancelled). Remembered for `session_ttl_s`:
        the open call of a request cancelled at its start may arrive after this close."""
        self._closed[session] = time.monotonic()
        self._sessions.pop(session, None)

    async def load(self) -> dict[str, Any]:
        """Open sessions and the replica-wide layer pass rate."""
        return {"open_sessions": len(self._sessions), "pass_rate": self._rho}

    def _knobs(self, state: _SessionKnobs) -> Knobs:
        if not state.adaptive:
            return state.limits
        return choose_knobs(
            state.rho, state.limits.gamma, state.limits.draft_width, len(self._sessions),
            state.iterations, self.policy,
        )  # fmt: skip

    def _expire(self) -> None:
        """Forget sessions whose router stopped reporting (a crashed router replica)."""
        limit = time.monotonic() - self.session_ttl_s
        for key in [k for k, s in self._sessions.items() if s.seen < limit]:
            del self._sessions[key]
        while self._closed and next(iter(self._closed.values())) < limit:  # oldest first
            del self._closed[next(iter(self._closed))]
