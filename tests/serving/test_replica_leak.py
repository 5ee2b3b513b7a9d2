"""No per-request leak in the serving path: what a soak run would show after hours, in seconds.

`dsbd bench soak` watches the server's processes for 30 minutes; a slow leak there (a session
never freed, a tensor kept per request, a dict that only grows) takes long to tell from an
allocator's high-water mark. Here the real classes of the serving path run in this process,
without Ray: `DecodeSession` (the router's decode loop) drives a real `Draft` and `Verifier`
replica and a `SessionRegistry` through handles that call them directly, as Serve would, for
rounds of concurrent decodes. After warm-up, a round must leave nothing behind: no cached or
open session, no tensor, no container object more than the round before (a leak of one object
per request would show as a growth of at least the round's request count), and the replicas'
bookkeeping of released ids empties once its TTL has passed.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from deployments.decode.local_handles import LocalHandle as Handle
from deployments.decode.session import DecodeSession
from deployments.decode.session_registry import SessionRegistry
from deployments.decode.state import Handles, RouterState
from deployments.replicas.draft import Draft
from deployments.replicas.verifier import Verifier
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.methods import method_config
from tests.support.tiny_models import build_pair

ROUND = 48  # decodes per round
CONCURRENT = 8  # of them at once (continuous batching shares the forwards)
TTL_S = 2.0  # the replicas' session TTL: their released ids are forgotten after it


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    target, draft = build_pair(tmp_path_factory.mktemp("models"))
    options = {"dtype": "float64", "session_ttl_s": TTL_S, "batch_wait_s": 0.0}
    return (
        Draft({"source": str(draft), **options}),
        Verifier({"source": str(target), **options}),
        SessionRegistry(None, TTL_S),
    )


async def _round(router: RouterState, vocab: int, first_seed: int) -> None:
    """ROUND decodes, CONCURRENT at a time, with different widths, depths and lengths."""
    limit = asyncio.Semaphore(CONCURRENT)

    async def one(i: int) -> None:
        config = SamplingConfig(
            width=2 + i % 2,
            gamma=1 + i % 3,
            max_new_tokens=6 + i % 7,
            seed=first_seed + i,
            eos_token_ids=(0,),
        )
        async with limit:
            session = DecodeSession(router, vocab, method_config("dsbd", config), adaptive=False)
            result = await session.run([5 + i % 40, 17, 42])
            assert result.beams

    await asyncio.gather(*(one(i) for i in range(ROUND)))
    # the release tasks (DecodeSession._release) end: a census taken while some still run
    # counts their tasks, futures and contexts (~2 objects each), more or fewer each round
    await router.drained()


WORKERS = 2  # the replicas' batches run in worker threads, one batch per replica at a time


def _in_every_worker(executor: ThreadPoolExecutor) -> None:
    """Block until every worker thread of `executor` runs a task of this call at once: each has
    then finished (and let go of) whatever it ran before. Starts the pool's threads too."""
    barrier = threading.Barrier(WORKERS + 1)
    for _ in range(WORKERS):
        executor.submit(barrier.wait)
    barrier.wait(timeout=30)


async def _idle(executor: ThreadPoolExecutor, *replicas: Any, timeout_s: float = 30.0) -> None:
    """Wait until no replica has a call queued or a batch running, then until every worker
    thread has dropped its last batch: a thread publishes a batch's result before it lets go
    of the work item (the batch's jobs: their step generators, pools and tensors), so on a
    loaded machine the loop runs on while a thread still holds them, and a census counts that
    batch once."""
    deadline = time.monotonic() + timeout_s
    while not all(replica.idle() for replica in replicas):
        assert time.monotonic() < deadline, "a replica still runs calls after the round"
        await asyncio.sleep(0.01)
    _in_every_worker(executor)


def _tensors() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _drop_cancelled_timers(loop: asyncio.AbstractEventLoop) -> None:
    """Do now what asyncio does lazily: forget the loop's cancelled timers.

    Every `asyncio.wait_for` (a release call's 30 s bound, say) schedules a timer and cancels it
    when the call returns; the loop leaves cancelled timers in its heap (each with a copied
    context) until more than 100 of them make up half the heap, then drops them all at once
    (`BaseEventLoop._run_once`). So a census can see ~2 objects per decode one round and none
    the next: bounded, not a leak. Dropping them first, the way `_run_once` does, lets the census
    count what the serving code keeps.
    """
    scheduled = loop._scheduled  # type: ignore[attr-defined]
    kept = [handle for handle in scheduled if not handle.cancelled()]
    for handle in scheduled:
        if handle.cancelled():
            handle._scheduled = False
    heapq.heapify(kept)
    loop._scheduled = kept  # type: ignore[attr-defined]
    loop._timer_cancelled_count = 0  # type: ignore[attr-defined]


def _census() -> tuple[int, int, Counter[str]]:
    """Objects, tensors, and objects by type (what a failure names)."""
    _drop_cancelled_timers(asyncio.get_running_loop())
    gc.collect()
    objects = gc.get_objects()
    return len(objects), _tensors(), Counter(type(o).__qualname__ for o in objects)


def _changed(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """The types whose count changed between two censuses, by how much."""
    return {k: after[k] - before[k] for k in before | after if after[k] != before[k]}


@pytest.mark.slow
def test_rounds_of_decodes_leave_nothing_behind(replicas) -> None:
    draft, verifier, controller = replicas
    handles = Handles(draft=Handle(draft), verifier=Handle(verifier), controller=Handle(controller))
    router = RouterState(handles)  # one router process across the rounds

    async def scenario() -> list[tuple[int, int, Counter[str]]]:
        # the pool's threads all started up front: it starts one whenever none has yet marked
        # itself idle, so on a loaded machine a round could add one (~30 objects, bounded)
        executor = ThreadPoolExecutor(max_workers=WORKERS)
        _in_every_worker(executor)
        asyncio.get_running_loop().set_default_executor(executor)  # shut down by asyncio.run
        censuses = []
        for index in range(4):  # round 0 warms up (caches, lazily built objects)
            await _round(router, verifier.vocab_size, first_seed=index * ROUND)
            await _idle(executor, draft, verifier)
            assert draft.batcher.cached == [] and verifier.batcher.cached == []
            assert (await controller.load())["open_sessions"] == 0
            assert len(draft._recent) <= 4 * draft.options.max_batch_size
            censuses.append(_census())
        await asyncio.sleep(TTL_S + 1.5)  # past the TTL: the sweeper forgets released ids
        assert draft._released == {} and verifier._released == {}
        return censuses

    censuses = asyncio.run(scenario())
    objects = [c[0] for c in censuses[1:]]
    tensors = [c[1] for c in censuses[1:]]
    print(f"after rounds 1..3 of {ROUND} decodes: objects {objects}, tensors {tensors}")
    types = [c[2] for c in censuses[1:]]
    changed = [_changed(a, b) for a, b in zip(types, types[1:], strict=False)]
    assert max(tensors) - min(tensors) == 0, f"tensors kept per request: {tensors}: {changed}"
    # one object kept per request would add >= ROUND per round; noise (interned caches) is small
    growth = [b - a for a, b in zip(objects, objects[1:], strict=False)]
    assert all(g < ROUND // 2 for g in growth), f"objects grow per round: {objects}: {changed}"


def test_the_router_times_each_iteration_around_its_replicas_compute(replicas) -> None:
    """`stats.serving.iteration_seconds` (benchmarks/investigations/served_iteration_cost/ at
    commit 27fa271 subtracts the replicas' compute from it): one per iteration, each holding its
    verify call's compute, and all together the draft's too."""
    draft, verifier, controller = replicas
    handles = Handles(draft=Handle(draft), verifier=Handle(verifier), controller=Handle(controller))
    config = SamplingConfig(width=3, gamma=2, max_new_tokens=12, seed=5, eos_token_ids=(0,))
    router = RouterState(handles)
    session = DecodeSession(
        router, verifier.vocab_size, method_config("dsbd", config), adaptive=False
    )
    result = asyncio.run(session.run([5, 17, 42]))
    s = session.stats
    assert len(s.iteration_seconds) == len(s.verify_seconds) == result.stats.iterations > 1
    assert all(r >= v for r, v in zip(s.iteration_seconds, s.verify_seconds, strict=True))
    assert sum(s.iteration_seconds) >= sum(s.verify_seconds) + sum(s.draft_seconds) > 0
