"""`/v1/dsbd/status` reports a replica that does not answer instead of hanging on it: a killed
replica's calls are held by Serve's handle until its replacement is up, which on a loaded
machine outlasts an operator's poll (and a client's read timeout)."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorUnavailableError

from deployments.api.served_model import _answer, _replica_status


class _Held:
    """A call Serve holds for a replica that is not there yet: never answers until cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self):
        return asyncio.get_event_loop().create_future().__await__()

    def cancel(self) -> None:
        self.cancelled = True


def test_a_replica_that_does_not_answer_is_reported_with_why() -> None:
    held = _Held()
    info = asyncio.run(_answer(held, timeout_s=0.05))
    assert info == {"replica": None, "pid": None, "unanswered": "no answer in 0.05 s"}
    assert held.cancelled  # not left queued for the replacement
    assert _replica_status(info)["cached_sessions"] is None  # never "drained" by accident


def test_a_ray_error_is_reported_not_raised() -> None:
    async def unavailable() -> dict:
        raise ActorUnavailableError("the replica's actor is unavailable\nmore detail", None)

    info = asyncio.run(_answer(unavailable()))
    assert info["pid"] is None
    assert info["unanswered"].endswith("the replica's actor is unavailable")  # first line only


def test_an_answer_passes_through() -> None:
    async def answer() -> dict:
        return {"replica": "r1", "pid": 42, "cached_sessions": ["a"]}

    assert asyncio.run(_answer(answer()))["pid"] == 42
