"""Continuous batching inside a replica: calls that arrive while a batch runs form the next one.

Why not `@serve.batch`: its loop forms the next batch as soon as one call is queued and only
then waits for the running batch to finish (the `max_concurrent_batches` semaphore), so with a
model forward of ~100 ms and calls arriving a few ms apart, every batch held one call (measured:
1.04 requests per verifier forward with 8 concurrent requests). Here the next batch is taken
when the previous one is done, so everything that queued meanwhile joins it, up to
`max_batch_size`. A batch also waits up to `wait_s` for the calls of sessions seen recently
(`expected()`), so requests that drifted apart fall back into step; a lone request never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any


class ContinuousBatcher:
    """Queue calls; run them in batches, one batch at a time, each call gets its own result."""

    def __init__(
        self,
        run_batch: Callable[[list[Any]], Awaitable[list[Any]]],
        *,
        max_batch_size: int,
        wait_s: float,
        expected: Callable[[], int],
    ) -> None:
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self._expected = expected
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task | None = None

    @property
    def idle(self) -> bool:
        """No call queued and no batch running."""
        return not self._pending and (self._worker is None or self._worker.done())

    async def submit(self, item: Any) -> Any:
        """Queue one call and wait for its result; a call's exception is raised to its caller."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await self._gather_companions()
            # A call whose caller was cancelled (its client went away) must not run: it would
            # re-create the session's cache after the router's release had freed it.
            self._pending = [(item, f) for item, f in self._pending if not f.done()]
            batch = self._pending[: self.max_batch_size]
            if not batch:
                continue
            self._pending = self._pending[self.max_batch_size :]
            try:
                results = await self._run_batch([item for item, _ in batch])
            except Exception as error:  # the whole batch failed: every caller gets the error
                results = [error] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # a caller that was cancelled no longer waits
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def _gather_companions(self) -> None:
        """Wait up to `wait_s` while fewer calls are queued than sessions recently active."""
        deadline = time.monotonic() + self.wait_s
        while len(self._pending) < min(self._expected(), self.max_batch_size):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout=left)
