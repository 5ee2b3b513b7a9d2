"""One request's decode, driven from the router: the decode loop's side calls go to deployments.

The loop is `dsbd_core.algorithm.drivers.loop.Decode` (the same loop `generate` and `dsbd batch`
run); this module is its serving driver. Per iteration the loop asks for the draft side
(`Draft.propose`) and the target side (`Verifier.verify`). The router holds only the small
`DecodeState`; the forest goes from the draft to the verifier as the draft's
`DeploymentResponse`, passed into the verifier call without being awaited here, so it travels
through the object store and never through this process. The verifier's reply carries the next
beams and their `Origin` (the accepted paths), which the next `IterationCall` brings to the
draft for its cache compaction.

Each iteration's draft depth is chosen by the cost model in this process
(`dsbd_core.algorithm.policy.cost_model.CostController`, from the pair's calibration, which the
replicas and the router replica measured once (`decode.state.RouterState`), and this request's
own history): no call per iteration, and knobs that do not depend on the load (`adaptive:
false`: the request's knobs as given).

A replica lost mid-iteration (its process died, or its tensor-parallel group broke) costs a
retry of that iteration, not the request: the router's state only changes when a reply is
applied, every side draws from a random stream seeded by (seed, iteration, side), and a
replica without the session's cache re-prefills from the token ids the call carries, so the
retried iteration draws exactly what the lost one would have. Retries back off and stop after
`retry_window_s` (the time Serve needs to replace a replica); other errors are not retried.
A seeded decode keeps its finished iterations (`replay.Lineage`): a replica that lacks its
cache answers `ReplayNeeded` and gets the call again with the history, from which it rebuilds
the cache bit for bit (a re-prefill's last bits differ, and so could its draws); after a lost
replica the history goes with the retry at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from deployments.decode import calibration as served_calibration
from deployments.decode.state import RouterState
from deployments.messages import IterationCall, TensorParallelBroken, VerifyReply
from deployments.observability.observers import SessionObserver
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.drivers.loop import Decode, Propose, Verify
from dsbd_core.algorithm.drivers.replay import Lineage, ReplayNeeded
from dsbd_core.algorithm.methods import MethodConfig, method_config
from dsbd_core.algorithm.policy.control import Controller, FixedKnobs, Knobs
from dsbd_core.algorithm.policy.cost_model import Calibration, CostController
from dsbd_core.algorithm.sequences.result import DecodeResult
from dsbd_core.algorithm.sequences.state import DecodeState, Outcome
from dsbd_core.algorithm.sequences.stops import StopStrings

# How long one iteration is retried while Serve replaces a lost replica (a health check
# failing, a fresh replica's imports and, for a tensor-parallel verifier, its ranks' start).
RETRY_WINDOW_S = 120.0


@dataclass
class ServingStats:
    """What the distributed path adds to `DecodeStats`, per iteration."""

    session: str
    gamma: list[int] = field(default_factory=list)  # depth planned (0 = no draft)
    draft_width: list[int] = field(default_factory=list)
    verify_batch_requests: list[int] = field(default_factory=list)  # requests in the forward
    verify_batch_sessions: list[int] = field(default_factory=list)
    verify_cache_hit: list[bool] = field(default_factory=list)
    verify_replica: list[str] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    draft_batch_requests: list[int] = field(default_factory=list)
    draft_forwards: list[int] = field(default_factory=list)
    draft_replica: list[str] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    # the router's seconds per iteration, from sending its calls to holding the verifier's reply
    # (retries included): minus verify_seconds and draft_seconds, what the calls themselves cost
    iteration_seconds: list[float] = field(default_factory=list)
    router_received: Counter = field(default_factory=Counter)  # type names awaited by the router
    retries: list[str] = field(default_factory=list)  # "iteration N: error" per retried call
    replays: list[str] = field(default_factory=list)  # lost caches rebuilt (seeded decodes)
    wall_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "router_received"}
        out["router_received"] = dict(self.router_received)
        return out


class DecodeSession:
    """Decode one prompt across the deployments; iterate to follow it, then take `result`."""

    def __init__(
        self,
        router: RouterState,
        vocab_size: int,
        config: MethodConfig,
        *,
        adaptive: bool = True,
        retry_window_s: float = RETRY_WINDOW_S,
        controller: Controller | None = None,
        stop: StopStrings | None = None,
    ) -> None:
        self.router = router
        self.stop = stop  # the request's stop strings (every iteration call carries them)
        self.handles = router.handles
        self.vocab_size = vocab_size
        self.config = config
        self.adaptive = adaptive
        self.retry_window_s = retry_window_s
        self.session = uuid.uuid4().hex
        self.stats = ServingStats(self.session)
        self.state: DecodeState | None = None
        self.controller: Controller | None = controller  # None: `_controller` chooses
        self._result: DecodeResult | None = None
        # seeded: the finished iterations, to rebuild a lost cache bit for bit (replay.py)
        self.lineage = Lineage() if config.seed is not None else None
        self.totals: dict[str, int] = {}  # what the request span reports (SessionObserver)

    async def iterations(self, prompt_ids: list[int]) -> AsyncGenerator[DecodeState, None]:
        """Run the decode; yields the state after every iteration (for streaming)."""
        start = time.perf_counter()
        limits = Knobs(gamma=self.config.draft_depth, draft_width=self.config.effective_draft_width)
        if self.controller is None:
            self.controller = await self._controller()
        decode = Decode(
            self.config,
            self.vocab_size,
            [prompt_ids],
            controller=self.controller,
            stop=self.stop,
        )
        state = self.state = decode.state
        observer = SessionObserver(self.session)  # spans and metrics (deployments/observability)
        self.totals = observer.totals
        steps = decode.steps()
        try:  # the open call too: a request cancelled while it runs still closes its session
            self.router.opened(self.session)
            await self.receive(
                self.handles.controller.open.remote(
                    self.session, limits, self.adaptive, self.router.name
                )
            )
            try:
                call = next(steps)
            except StopIteration as stop:  # nothing to decode (not reached for valid input)
                self._result = stop.value[0]
                return
            while True:
                draft = isinstance(call, Propose)
                if draft:  # the draft side is sent together with the verify call below
                    call = steps.send(call)
                assert isinstance(call, Verify)
                outcome = await self._observed(observer, call.call, state, draft=draft)
                try:
                    call = steps.send(outcome)
                except StopIteration as stop:
                    self._result = stop.value[0]
                    yield state
                    break
                yield state
        finally:
            steps.close()
            self.stats.wall_seconds = time.perf_counter() - start
            observer.close()
            self._release()

    async def run(self, prompt_ids: list[int]) -> DecodeResult:
        """Decode to the end and return the result."""
        async for _ in self.iterations(prompt_ids):
            pass
        return self.result()

    async def _controller(self) -> Controller:
        """The cost model (`adaptive`, a drafting method, a calibrated pair), else the
        request's own knobs every iteration."""
        if self.adaptive and self.config.uses_draft:
            calibration = await pair_calibration(self.router)
            if calibration is not None:
                policy = await self.router.policy()
                return CostController(self.config, calibration, policy)
        return FixedKnobs(self.config)

    def result(self) -> DecodeResult:
        assert self._result is not None, "run the decode to its end first"
        return self._result

    async def _observed(
        self, observer: SessionObserver, call: IterationCall, state: DecodeState, *, draft: bool
    ) -> Outcome:
        """One iteration's calls inside its span; its reply recorded in the stats."""
        config = call.config
        assert state.depth is not None
        retries = len(self.stats.retries)
        knobs = Knobs(gamma=config.draft_depth, draft_width=config.effective_draft_width)
        with observer.iteration(
            state.iteration, knobs.gamma, knobs.draft_width, int(state.depth.max())
        ) as observed:
            start = time.perf_counter()
            reply = await self._iteration(replace(call, trace=observed.trace), draft=draft)
            self.stats.iteration_seconds.append(time.perf_counter() - start)
            self._record(reply, knobs)
            observed.done(reply, retries=len(self.stats.retries) - retries)
        return reply.outcome

    async def _iteration(self, call: IterationCall, *, draft: bool) -> VerifyReply:
        """Draft and verify one iteration; retried while replicas are being replaced."""
        deadline = time.monotonic() + self.retry_window_s
        delay = 0.2
        history = False  # sent with the call: after a replica asked for it, or was lost
        lineage = self.lineage
        while True:
            sent = lineage.tag(call, history=history) if lineage is not None else call
            forest = (
                self.handles.draft.propose.remote(self.session, sent) if draft else None
            )  # a DeploymentResponse: handed on, never awaited here
            try:
                reply = await self.receive(
                    self.handles.verifier.verify.remote(self.session, sent, forest)
                )
                if lineage is not None:
                    lineage.record(call, drafted=draft, layers=reply.layers or [])
                return reply
            except Exception as error:
                if lineage is not None and not history and _in_chain(error, (ReplayNeeded,)):
                    self.stats.replays.append(
                        f"iteration {call.state.iteration}: a replica had no cache, history sent"
                    )
                    history = True
                    continue
                lost = lost_replica(error)
                if lost is None or time.monotonic() + delay > deadline:
                    raise
                first = str(error).strip().splitlines()[0][:200] if str(error) else ""
                cause = "" if lost is error else f" ({type(lost).__name__})"
                self.stats.retries.append(
                    f"iteration {call.state.iteration}: {type(error).__name__}{cause}: {first}"
                )
                history = lineage is not None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    async def receive(self, response: Any) -> Any:
        value = await response
        self.stats.router_received[type(value).__name__] += 1
        return value

    def _record(self, reply: VerifyReply, knobs: Knobs) -> None:
        s = self.stats
        s.gamma.append(knobs.gamma)
        s.draft_width.append(knobs.draft_width)
        s.verify_batch_requests.append(reply.report.batch.requests)
        s.verify_batch_sessions.append(reply.report.batch.sessions)
        s.verify_cache_hit.append(bool(reply.report.batch.reused))
        s.verify_replica.append(reply.report.replica)
        s.verify_seconds.append(reply.report.seconds)
        for side, report in (("verifier", reply.report), ("draft", reply.draft)):
            replayed = report.batch.replayed.get(self.session) if report is not None else None
            if replayed:
                s.replays.append(
                    f"iteration {len(s.gamma) - 1}: {side} replayed {replayed} iterations"
                )
        if reply.draft is not None:
            s.draft_batch_requests.append(reply.draft.batch.requests)
            s.draft_forwards.append(reply.draft.batch.forwards)
            s.draft_replica.append(reply.draft.replica)
            s.draft_seconds.append(reply.draft.seconds)

    def _release(self) -> None:
        """Free the session everywhere; TTLs catch what this misses.

        Runs as its own task in an empty context: Serve cancels the child calls of a cancelled
        request (a client that went away), and these calls must outlive it.
        """
        handles, session, uses_draft = self.handles, self.session, self.config.uses_draft
        self.router.closed(session)

        async def release() -> None:
            # the caches first, the controller's registry last: a router that dies in between
            # leaves the session registered, and the controller frees it once the router is
            # silent (session_registry); the other order could lose the caches with it
            models = [handles.verifier.release.remote(session)]
            if uses_draft:
                models.append(handles.draft.release.remote(session))
            for calls in (models, [handles.controller.close.remote(session)]):
                await asyncio.gather(
                    *(asyncio.wait_for(call, timeout=30) for call in calls), return_exceptions=True
                )

        self.router.run_detached(release())


async def pair_calibration(router: RouterState) -> Calibration | None:
    """The deployed pair's calibration (`decode.calibration.pair_calibration`), its measuring
    decodes run as sessions of this module with fixed knobs."""

    async def run(
        vocab_size: int, config: SamplingConfig, controller: Controller, prompt: list[int]
    ) -> None:
        session = DecodeSession(
            router, vocab_size, method_config("dsbd", config), adaptive=False, controller=controller
        )
        await session.run(prompt)

    return await served_calibration.pair_calibration(router, run)


_LOST = (
    RayActorError,
    ActorUnavailableError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
    TensorParallelBroken,
)


def lost_replica(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain that means a replica went away (retry elsewhere), if any;
    None for a bad request.

    Ray wraps a remote error in a `RayTaskError` that is also an instance of its cause's type,
    and an error of the draft reaches the router through the verifier call (a draft that dies
    while the verifier waits for its forest: a `RayServeException` whose cause is the draft's
    `ActorDiedError`); the whole chain of causes is searched.
    """
    return _in_chain(error, _LOST)


def _in_chain(error: BaseException, types: tuple[type, ...]) -> BaseException | None:
    """The first error of one of `types` in `error`'s chain of causes and contexts."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, types):
            return current
        stack += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return None


def committed_tokens(state: DecodeState) -> list[int]:
    """Generated tokens every current candidate (live beam or finished one) starts with.

    Every final beam extends one of today's candidates, so this prefix is final: it is what a
    stream can send without ever taking text back.
    """
    start, end = int(state.prompt_len[0]), int(state.length[0])
    candidates = [
        state.tokens[0, j, start:end].tolist() for j in state.alive[0].nonzero().squeeze(1).tolist()
    ]
    pool = state.pool
    for tokens, lengths, kept in zip(pool.tokens, pool.length, pool.kept, strict=True):
        for row, n, k in zip(tokens.tolist(), lengths.tolist(), kept.tolist(), strict=True):
            if k:
                candidates.append(row[:n])
    if not candidates:
        return []
    prefix = candidates[0]
    for other in candidates[1:]:
        n = 0
        while n < min(len(prefix), len(other)) and prefix[n] == other[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def accepted_per_position(result: DecodeResult) -> list[int]:
    """Iterations whose position i (1-based) draft layer was accepted (vLLM's per-pos metric)."""
    layers = result.stats.accepted_layers
    deepest = max(layers, default=0)
    return [sum(1 for a in layers if a >= i) for i in range(1, deepest + 1)]
