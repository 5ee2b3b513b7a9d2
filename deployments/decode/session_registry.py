"""The session registry deployment: the fleet's open decodes, and the application's cost policy.

It chooses no knob. Each request's speed knobs (the draft depth per iteration) are chosen by the
cost model in the router's decode loop (`dsbd_core.algorithm.policy.cost_model.CostController`,
from the pair's measured calibration and the request's own history: a deterministic choice, so
the knobs never make a seeded request depend on the load; docs/SERVING.md "Seeded decodes and
numerics" says when the numerics do); the distribution-defining knobs (W, t, w_min,
temperature, ...) are the request's. This deployment keeps what no single router sees: the open
sessions of every router replica (`/v1/dsbd/status`), and hands routers the `CostPolicy` of the
application (its priors), so that every router chooses alike.

A router replica that dies (SIGKILL, a lost node) never closes its sessions. So every router process
that has decodes sends a heartbeat every `HEARTBEAT_S` with the sessions it runs
(`deployments.decode.state.RouterState.keep_reporting`): the heartbeat prunes the sessions of that
router it no longer lists (a close that was lost), and a router not heard from for `ROUTER_SILENT_S`
loses its sessions here. Found by `dsbd bench chaos`: 9 sessions of killed routers stayed open for
the 600 s session TTL (and a decode running longer than that TTL would have been dropped from the
count while it ran). The draft and verifier replicas held those sessions' caches just as long (the
dead router never released them; its decodes go on under new session ids on another router): so the
sessions of a silent router, and those a heartbeat no longer lists (a close lost), are also released
on the draft and the verifier from here (a router releases the caches before it closes the session
here, so one that dies in between leaves the session registered) (`dsbd bench chaos` with four
kills, a router's among them: 5 verifier and 2 draft caches still held 60 s after the load ended,
until this)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from dsbd_core.algorithm.policy.control import Knobs
from dsbd_core.algorithm.policy.cost_model import CostPolicy

HEARTBEAT_S = 5.0  # how often a router with open sessions reports them
ROUTER_SILENT_S = 6 * HEARTBEAT_S  # a router not heard from for this long is taken as dead


@dataclass
class _SessionKnobs:
    limits: Knobs  # the request's gamma (a maximum) and draft width
    adaptive: bool  # the cost model chooses the depth (False: the request's knobs as given)
    router: str  # the router process that runs it (`RouterState.name`)
    opened: float


class SessionRegistry:
    """One replica: it is a small dict of sessions and a few arithmetic operations per call."""

    def __init__(
        self,
        policy: dict[str, Any] | None = None,
        session_ttl_s: float = 600.0,
        draft: Any = None,
        verifier: Any = None,
    ) -> None:
        """`draft`, `verifier`: the handles of the model replicas that cache the sessions (None
        in the co-located layout: a pair's caches die with its decode loops)."""
        self.policy = CostPolicy.model_validate(policy or {})
        self.session_ttl_s = session_ttl_s
        self._models = [h for h in (verifier, draft) if h is not None]
        self._releasing: set[asyncio.Task] = set()
        self._sessions: dict[str, _SessionKnobs] = {}
        self._closed: dict[str, float] = {}  # session -> when closed (see `close`)
        self._routers: dict[str, float] = {}  # router process -> when last heard from

    async def open(
        self,
        session: str,
        limits: Knobs,
        adaptive: bool = True,
        router: str = "",
    ) -> Knobs:
        """Register a request; returns the knobs it starts from (its own: the cost model in the
        router refines the depth per iteration within them)."""
        now = time.monotonic()
        self._routers[router] = now  # an open is a sign of life too
        self._expire()
        if session not in self._closed:  # else: a late open of a request that has ended
            self._sessions[session] = _SessionKnobs(limits, adaptive, router, now)
        return limits

    async def heartbeat(self, router: str, sessions: list[str]) -> None:
        """`router` is alive and runs `sessions`: forget its other sessions (their close was
        lost), except those opened within a heartbeat (the list may predate them)."""
        now = time.monotonic()
        self._routers[router] = now
        running = set(sessions)
        recent = now - HEARTBEAT_S
        mine = [(key, s) for key, s in self._sessions.items() if s.router == router]
        lost = [key for key, s in mine if key not in running and s.opened < recent]
        for key in lost:
            del self._sessions[key]
        self._send_releases(lost)  # a close lost with its caches' releases
        self._expire()

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
        self._expire()
        adaptive = sum(1 for s in self._sessions.values() if s.adaptive)
        return {"open_sessions": len(self._sessions), "adaptive_sessions": adaptive}

    def _send_releases(self, sessions: list[str]) -> None:
        """Free `sessions`' caches on the draft and the verifier, in the background."""
        if sessions and self._models:
            task = asyncio.get_running_loop().create_task(self._release(sessions))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _release(self, sessions: list[str]) -> None:
        """Free the caches of a dead router's sessions on the draft and the verifier (a replica
        that is gone, or holds none of them, has nothing to free)."""
        for session in sessions:
            for model in self._models:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(model.release.remote(session), timeout=30)

    def _expire(self) -> None:
        """Forget the sessions of routers silent for ROUTER_SILENT_S (a crashed router
        replica), and closes older than the session TTL."""
        now = time.monotonic()
        silent = {r for r, seen in self._routers.items() if seen < now - ROUTER_SILENT_S}
        orphans = [k for k, s in self._sessions.items() if s.router in silent]
        for key in orphans:
            del self._sessions[key]
            self._closed[key] = now  # a late open of it registers nothing
        self._send_releases(orphans)
        for router in silent:
            del self._routers[router]
        limit = now - self.session_ttl_s
        while self._closed and next(iter(self._closed.values())) < limit:  # oldest first
            del self._closed[next(iter(self._closed))]
