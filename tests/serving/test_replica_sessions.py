"""Sessions end for good: the races that leaked caches and controller sessions under load.

Found by `dsbd bench load` (clients that go away mid-decode,
docs/history/RELIABILITY-chronicle.md): after a
run, sessions stayed open on the session registry and cached on the draft until their TTL.
Each test below replays one race deterministically on the real classes (a real tiny model in
the draft replica; no Serve: the classes are called as Serve would call them).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from deployments.decode import session_registry
from deployments.decode.local_handles import LocalHandle
from deployments.decode.session_registry import SessionRegistry
from deployments.decode.state import Handles, RouterState
from deployments.replicas.continuous_batch import ContinuousBatcher
from deployments.replicas.draft import Draft
from deployments.replicas.model_replica import SessionReleased
from dsbd_core.algorithm.policy.control import Knobs
from tests.support.iteration_calls import first_call
from tests.support.tiny_models import build_pair


def test_a_cancelled_callers_queued_call_never_runs() -> None:
    """A call still queued when its caller is cancelled (its client went away) is dropped."""
    ran: list[list[str]] = []
    gate = asyncio.Event()

    async def run_batch(items: list[str]) -> list[str]:
        ran.append(items)
        await gate.wait()
        return items

    async def scenario() -> None:
        batcher = ContinuousBatcher(run_batch, max_batch_size=8, wait_s=0, expected=lambda: 0)
        first = asyncio.create_task(batcher.submit("a"))
        await asyncio.sleep(0.01)  # "a" runs, held at the gate; the next two queue behind it
        gone = asyncio.create_task(batcher.submit("gone"))
        kept = asyncio.create_task(batcher.submit("kept"))
        await asyncio.sleep(0.01)
        gone.cancel()
        gate.set()
        assert await first == "a" and await kept == "kept"
        with pytest.raises(asyncio.CancelledError):
            await gone

    asyncio.run(scenario())
    assert ran == [["a"], ["kept"]]


@pytest.fixture(scope="module")
def draft_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_pair(tmp_path_factory.mktemp("models"))[1]


def test_a_release_that_overtakes_a_queued_call_leaves_no_cache(draft_source: Path) -> None:
    """The draft call of a cancelled request is never awaited by the router, so nothing
    cancels it: it can sit in the replica's queue behind a running batch while the router's
    release arrives and frees the session. Running it afterwards must not cache the session
    again; a call that arrives after the release is refused."""
    replica = Draft({"source": str(draft_source), "dtype": "float64"})
    call = first_call(replica.vocab_size, [5, 6, 7])
    hold, run = threading.Event(), replica.batcher.run

    def slow_run(jobs):  # the batch of session "busy" runs until the test lets it go
        if any(job.key == "busy" for job in jobs):
            hold.wait(timeout=30)
        return run(jobs)

    replica.batcher.run = slow_run

    async def scenario() -> None:
        busy = asyncio.create_task(replica.propose("busy", call))
        await asyncio.sleep(0.2)  # its batch runs (holding the replica's lock)
        late = asyncio.create_task(replica.propose("gone", call))  # queued behind it
        await asyncio.sleep(0.05)
        release = asyncio.create_task(replica.release("gone"))  # waits for the lock first
        await asyncio.sleep(0.05)
        hold.set()
        await asyncio.gather(busy, release, late)
        assert replica.batcher.cached == ["busy"]
        with pytest.raises(SessionReleased, match="gone"):
            await replica.propose("gone", call)

    asyncio.run(scenario())


def test_an_open_that_arrives_after_its_close_registers_nothing() -> None:
    """A request cancelled while its `open` call is on the way closes its session; the open
    may still arrive afterwards and must not leave an open session (until the TTL)."""
    controller = SessionRegistry()

    async def scenario() -> None:
        await controller.close("gone")
        knobs = await controller.open("gone", Knobs(gamma=2, draft_width=2))
        assert knobs.gamma <= 2  # the caller (if any were left) still gets an answer
        assert (await controller.load())["open_sessions"] == 0
        await controller.open("live", Knobs(gamma=2, draft_width=2))
        assert (await controller.load())["open_sessions"] == 1

    asyncio.run(scenario())


def test_the_sessions_of_a_router_that_stops_reporting_are_forgotten(monkeypatch) -> None:
    """A SIGKILLed router never closes its sessions (`dsbd bench chaos` found 9 left open for
    the 600 s TTL). Routers report theirs every HEARTBEAT_S; a silent one loses them after
    ROUTER_SILENT_S, a reporting one keeps them past any TTL, and a session missing from its
    router's report (a lost close) goes unless it was opened within the last heartbeat. A silent
    router's sessions are also released on the draft and the verifier (their caches)."""
    clock = [1000.0]
    monkeypatch.setattr(session_registry.time, "monotonic", lambda: clock[0])
    released: list[tuple[str, str]] = []

    class Model:  # the draft's or the verifier's replica: what it is asked to free
        def __init__(self, side: str) -> None:
            self.side = side

        async def release(self, session: str) -> bool:
            released.append((self.side, session))
            return True

    draft, verifier = LocalHandle(Model("draft")), LocalHandle(Model("verifier"))
    controller = SessionRegistry(None, 600.0, draft, verifier)
    knobs = Knobs(gamma=2, draft_width=2)

    async def scenario() -> dict[str, int]:
        open_now = {}
        await controller.open("dead-1", knobs, router="killed")
        await controller.open("dead-2", knobs, router="killed")
        await controller.open("long", knobs, router="alive")
        while clock[0] < 1000.0 + 700:  # "alive" reports every heartbeat for 700 s
            clock[0] += session_registry.HEARTBEAT_S
            await controller.heartbeat("alive", ["long"])
            if clock[0] == 1000.0 + 2 * session_registry.HEARTBEAT_S:
                open_now["before"] = (await controller.load())["open_sessions"]
        open_now["after"] = (await controller.load())["open_sessions"]
        await controller.open("fresh", knobs, router="alive")
        await controller.open("lost-close", knobs, router="alive")
        clock[0] += 1.0  # a heartbeat whose list predates "fresh" keeps it
        await controller.heartbeat("alive", ["long", "lost-close"])
        open_now["fresh kept"] = (await controller.load())["open_sessions"]
        clock[0] += session_registry.HEARTBEAT_S + 1.0
        await controller.heartbeat("alive", ["long"])
        open_now["lost close pruned"] = (await controller.load())["open_sessions"]
        await asyncio.gather(*controller._releasing)  # the releases it sent off
        return open_now

    seen = asyncio.run(scenario())
    assert seen == {"before": 3, "after": 1, "fresh kept": 3, "lost close pruned": 1}
    # the dead router's sessions and the two its last report left out (their close lost), and
    # only those, were freed on the draft and the verifier
    freed = ["dead-1", "dead-2", "fresh", "lost-close"]
    assert sorted(released) == [(side, s) for side in ("draft", "verifier") for s in freed]


def test_a_router_reports_its_open_sessions_until_none_is_left(monkeypatch) -> None:
    """RouterState.keep_reporting: one heartbeat task per router process and event loop,
    sending what is open there; it ends by itself once nothing is, and at once on the last
    session's close, so an idle router holds no pending task."""
    monkeypatch.setattr(session_registry, "HEARTBEAT_S", 0.01)
    beats: list[list[str]] = []

    class Remote:
        async def remote(self, router: str, sessions: list[str]) -> None:
            assert router == state.name
            beats.append(sessions)

    controller = type("Controller", (), {"heartbeat": Remote()})()
    state = RouterState(Handles(draft=None, verifier=None, controller=controller))

    async def scenario() -> None:
        state.opened("b")
        state.opened("a")
        first = state._heartbeat
        state.keep_reporting()  # already running: no second task
        assert state._heartbeat is first and first is not None
        await asyncio.sleep(0.05)
        state.open.clear()
        await asyncio.wait_for(first, 1.0)  # ends by itself within a heartbeat
        monkeypatch.setattr(session_registry, "HEARTBEAT_S", 60.0)
        state.opened("c")
        second = state._heartbeat
        assert second is not first and second is not None
        await asyncio.sleep(0.01)  # its first beat, then a 60 s sleep
        state.closed("c")  # the last session here: the heartbeat ends at once
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(second, 1.0)

    asyncio.run(scenario())
    assert beats[0] == ["a", "b"] and beats[-1] == ["c"] and len(beats) >= 3
    assert all(b in (["a", "b"], ["c"]) for b in beats)
