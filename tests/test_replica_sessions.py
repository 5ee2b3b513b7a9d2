"""Sessions end for good: the races that leaked caches and controller sessions under load.

Found by `benchmarks/load.py` (clients that go away mid-decode, docs/RELIABILITY.md): after a
run, sessions stayed open on the width controller and cached on the draft until their TTL.
Each test below replays one race deterministically on the real classes (a real tiny model in
the draft replica; no Serve: the classes are called as Serve would call them).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from deployments.continuous_batch import ContinuousBatcher
from deployments.draft import Draft
from deployments.messages import IterationCall
from deployments.model_replica import SessionReleased
from deployments.width_controller import WidthController
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.control import Knobs
from dsbd_core.algorithm.engine import Engine

from .tiny_models import build_pair


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


def _call(vocab: int, prompt: list[int]) -> IterationCall:
    """The router's first iteration of a DSBD request (what `DecodeSession` sends the draft)."""
    config = SamplingConfig(width=2, gamma=2, max_new_tokens=8, seed=0, eos_token_ids=(0,))
    engine = Engine(config, vocab, uses_draft=True)
    state = engine.start([prompt])
    assert engine.next_iteration(state)
    return IterationCall(state.for_models(), config, True)


def test_a_release_that_overtakes_a_queued_call_leaves_no_cache(draft_source: Path) -> None:
    """The draft call of a cancelled request is never awaited by the router, so nothing
    cancels it: it can sit in the replica's queue behind a running batch while the router's
    release arrives and frees the session. Running it afterwards must not cache the session
    again; a call that arrives after the release is refused."""
    replica = Draft.func_or_class({"source": str(draft_source), "dtype": "float64"})
    call = _call(replica.vocab_size, [5, 6, 7])
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
    controller = WidthController.func_or_class()

    async def scenario() -> None:
        await controller.close("gone")
        knobs = await controller.open("gone", Knobs(gamma=2, draft_width=2))
        assert knobs.gamma <= 2  # the caller (if any were left) still gets an answer
        assert (await controller.load())["open_sessions"] == 0
        await controller.open("live", Knobs(gamma=2, draft_width=2))
        assert (await controller.load())["open_sessions"] == 1

    asyncio.run(scenario())
