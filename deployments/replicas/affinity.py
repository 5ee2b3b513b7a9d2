"""Session affinity: send every call of a decode session to the replica holding its KV cache.

A Ray Serve request router (the `RequestRouterConfig` extension point) for the draft and the
verifier. Every call's first argument is the session id; the router remembers which replica
served a session's last call and ranks that replica first, falling back to Serve's
power-of-two-choices among the others when it is gone or full. The map lives in the handle of
the router replica that drives the session, which sees all of the session's calls. Affinity is
only an optimisation: a call that lands elsewhere re-prefills from the token ids it carries.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

ROUTER_CLASS = "deployments.replicas.affinity.SessionAffinityRouter"


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Power of two choices, except that a session's home replica is tried first."""

    def initialize_state(self, max_sessions: int = 100_000, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._home: OrderedDict[str, ReplicaID] = OrderedDict()
        self._max_sessions = max_sessions

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ranked = await super().choose_replicas(candidate_replicas, pending_request)
        home = self._home.get(_session(pending_request) or "")
        if home is None:
            return ranked
        chosen = [r for r in candidate_replicas if r.replica_id == home]
        return [chosen, *ranked] if chosen else ranked

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        session = _session(pending_request)
        if session is None:
            return
        self._home[session] = replica_id
        self._home.move_to_end(session)
        while len(self._home) > self._max_sessions:
            self._home.popitem(last=False)


def _session(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, str) else None
