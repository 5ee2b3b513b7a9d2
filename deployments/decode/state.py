"""What one router process keeps across the decodes it runs: the deployments it drives, the
pair's calibration (forward costs and pass rates) and the application's cost policy (built or
read once), the sessions open here and the heartbeat that reports them, and the release tasks
still running.

The Router deployment owns one `RouterState` (deployments/decode/router.py); each `DecodeSession` it
starts is given it. The state lives as long as the replica: a replica that dies takes it along,
and the session registry forgets its sessions once its heartbeat stops
(deployments/decode/session_registry.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from deployments.decode import session_registry
from dsbd_core.algorithm.policy.cost_model import Calibration, CostPolicy

# How long after a failed calibration the next adaptive request measures the pair again.
CALIBRATION_RETRY_S = 60.0


@dataclass
class Handles:
    """The deployments a router drives (Ray Serve `DeploymentHandle`s)."""

    draft: Any
    verifier: Any
    controller: Any


class RouterState:
    """One router process's state (see the module docstring)."""

    def __init__(self, handles: Handles, layout: str = "split") -> None:
        self.handles = handles
        # how the draft and the verifier are reached: what a served iteration costs depends
        # on it, so the calibration's cache tells the layouts apart
        self.layout = layout
        # the name the session registry knows this process's sessions by
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.open: set[str] = set()  # sessions decoding here, reported every heartbeat
        self._calibration: Calibration | None = None
        self._calibrated = False
        # why the last calibration's decodes failed (None: they did not), and when to retry
        self.calibration_error: str | None = None
        self._retry_at = 0.0
        self._calibrating = asyncio.Lock()  # concurrent first requests wait for one calibration
        self._policy: CostPolicy | None = None
        self._heartbeat: asyncio.Task | None = None
        self._releasing: set[asyncio.Task] = set()  # referenced until they finish

    async def calibration(
        self, build: Callable[[], Awaitable[Calibration | None]]
    ) -> Calibration | None:
        """The pair's calibration, built once by `build` (the first adaptive request waits for
        it; `decode.session.pair_calibration` builds it). None: the pair has none."""
        async with self._calibrating:
            failed = self.calibration_error is not None
            if not self._calibrated or (failed and time.monotonic() >= self._retry_at):
                self.calibration_error = None  # `build` records a new failure here
                self._calibration = await build()
                self._calibrated = True
                self._retry_at = time.monotonic() + CALIBRATION_RETRY_S
        return self._calibration

    def failed_calibration(self, error: BaseException) -> None:
        """The calibration's decodes failed: what they measured stands, the rest is the
        policy's priors until the retry (the first adaptive request `CALIBRATION_RETRY_S`
        later); `/v1/dsbd/status` shows why (`calibration_status`)."""
        self.calibration_error = f"{type(error).__name__}: {error}"[:500]
        print(f"router: the pair's calibration decodes failed ({error!r})", flush=True)

    def calibration_status(self) -> dict[str, Any]:
        """What the router's status reports of its calibration."""
        state = "pending" if not self._calibrated else "measured"
        if self._calibrated and self._calibration is None:
            state = "none"  # a pair without costs (a tensor-parallel target): fixed knobs
        if self.calibration_error is not None:
            state = "failed"
        return {
            "state": state,
            "error": self.calibration_error,
            "retry_in_s": max(0.0, round(self._retry_at - time.monotonic(), 1))
            if self.calibration_error is not None
            else None,
        }

    async def policy(self) -> CostPolicy:
        """The application's cost policy (the session registry holds it), read once."""
        if self._policy is None:
            self._policy = await self.handles.controller.cost_policy.remote()
        return self._policy

    def opened(self, session: str) -> None:
        """A session starts decoding here: report it from now on."""
        self.open.add(session)
        self.keep_reporting()

    def closed(self, session: str) -> None:
        """A session ended here; the last one ends the heartbeat."""
        self.open.discard(session)
        if not self.open:
            self.stop_reporting()

    def keep_reporting(self) -> None:
        """Start the heartbeat to the session registry unless it runs in this event loop; it
        ends by itself once no session is open (the next session starts it again)."""
        running, loop = self._heartbeat, asyncio.get_running_loop()
        if running is not None and not running.done() and running.get_loop() is loop:
            return
        controller = self.handles.controller

        async def beat() -> None:
            while self.open:
                with contextlib.suppress(Exception):  # a controller restarting: the next beat
                    await asyncio.wait_for(
                        controller.heartbeat.remote(self.name, sorted(self.open)),
                        session_registry.HEARTBEAT_S,
                    )
                await asyncio.sleep(session_registry.HEARTBEAT_S)

        self._heartbeat = loop.create_task(beat(), context=contextvars.Context())

    def stop_reporting(self) -> None:
        """No session is open here: end the heartbeat now rather than after its sleep, so an
        idle router holds no pending task (each session's close already told the controller)."""
        running = self._heartbeat
        with contextlib.suppress(RuntimeError):  # no running loop, or the task's has closed
            if running is not None and running.get_loop() is asyncio.get_running_loop():
                running.cancel()

    async def drained(self) -> None:
        """Wait until every release task started here has ended: what a census of the
        router's objects (tests) waits for, instead of guessing how long releases take."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)

    def run_detached(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as a task of its own in an empty context, kept referenced until it ends:
        Serve cancels the child calls of a cancelled request (a client that went away), and a
        session's release must outlive it. Without a running loop there is nothing to run it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work.close()
            return
        task = loop.create_task(work, context=contextvars.Context())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
