"""The width controller deployment: the fleet's view of open decodes and the cost policy.

Each request's speed knobs (the draft depth per iteration) are chosen by the cost model in the
router's decode loop (`dsbd_core.algorithm.cost_model.CostController`, from the pair's measured
calibration and the request's own history: a deterministic choice, so a seeded request decodes
the same tokens whatever else the server does). The distribution-defining knobs (W, t, w_min,
temperature, ...) are the request's. This deployment keeps what no single router sees: the open
sessions of every router replica (`/v1/dsbd/status`), and hands routers the `CostPolicy` of the
application (its priors), so that every router chooses alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ray import serve

from dsbd_core.algorithm.control import Knobs
from dsbd_core.algorithm.cost_model import CostPolicy


@dataclass
class _SessionKnobs:
    limits: Knobs  # the request's gamma (a maximum) and draft width
    adaptive: bool  # the cost model chooses the depth (False: the request's knobs as given)
    seen: float


@serve.deployment(
    name="WidthController", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
)
class WidthController:
    """One replica: it is a small dict of sessions and a few arithmetic operations per call."""

    def __init__(self, policy: dict[str, Any] | None = None, session_ttl_s: float = 600.0) -> None:
        self.policy = CostPolicy.model_validate(policy or {})
        self.session_ttl_s = session_ttl_s
        self._sessions: dict[str, _SessionKnobs] = {}
        self._closed: dict[str, float] = {}  # session -> when closed (see `close`)

    async def open(self, session: str, limits: Knobs, adaptive: bool = True) -> Knobs:
        """Register a request; returns the knobs it starts from (its own: the cost model in the
        router refines the depth per iteration within them)."""
        self._expire()
        if session not in self._closed:  # else: a late open of a request that has ended
            self._sessions[session] = _SessionKnobs(limits, adaptive, time.monotonic())
        return limits

    async def close(self, session: str) -> None:
        """The request ended (finished, failed or cancelled). Remembered for `session_ttl_s`:
        the open call of a request cancelled at its start may arrive after this close."""
        self._closed[session] = time.monotonic()
        self._sessions.pop(session, None)

    async def cost_policy(self) -> CostPolicy:
        """The application's cost policy (priors of the pass rates, probing)."""
        return self.policy

    async def load(self) -> dict[str, Any]:
        """Open sessions across the routers, and how many let the cost model choose."""
        adaptive = sum(1 for s in self._sessions.values() if s.adaptive)
        return {"open_sessions": len(self._sessions), "adaptive_sessions": adaptive}

    def _expire(self) -> None:
        """Forget sessions whose router stopped reporting (a crashed router replica)."""
        limit = time.monotonic() - self.session_ttl_s
        for key in [k for k, s in self._sessions.items() if s.seen < limit]:
            del self._sessions[key]
        while self._closed and next(iter(self._closed.values())) < limit:  # oldest first
            del self._closed[next(iter(self._closed))]
