"""Decode many independent requests together: each its own method, config and seed; shared forwards.

`generate_batch` decodes several prompts with ONE config and ONE random stream (the prompts are
rows of one engine state), so a prompt's result depends on its batch mates. A batch job needs
every row to be reproducible on its own: its own method, knobs and seed. Here every request
keeps its own decode loop (`loop.Decode`; its random streams are seeded by (seed, iteration,
side)), and only the model forwards are shared: each round the loops that ask for a draft side
run as one `SessionBatcher` batch on the draft model, then every loop's target side as one batch
on the target. That is what the serving replicas do across processes; here it is one driver in
one process, and a request decodes exactly what `generate` decodes for it alone
(tests/batch/test_batch.py checks it draw for draw in float64).

A request that cannot start (bad prompt, a draft method without a draft) or whose step fails
gets its error back; the others go on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.drivers.loop import Decode, Propose, SideCall, Verify
from dsbd_core.algorithm.drivers.session_batch import Job, SessionBatcher
from dsbd_core.algorithm.methods import MethodConfig, method_config
from dsbd_core.algorithm.policy.control import Controller
from dsbd_core.algorithm.sequences.result import DecodeResult
from dsbd_core.algorithm.sequences.stops import StopStrings


@dataclass(frozen=True)
class Request:
    """One decode: prompt ids, the config as given, and the method that maps it (decoders.py)."""

    prompt_ids: list[int]
    config: SamplingConfig
    method: str = "dsbd"
    # stop strings: a beam finishes where its text first holds one (stops.py), as `generate`
    stop: StopStrings | None = None


# (request, the config its method runs with, whether it drafts) -> its controller, or None
ControllerFactory = Callable[["Request", MethodConfig], Controller | None]


@dataclass
class RequestResult:
    """A request's result or its error, the seed it ran with and when it finished."""

    result: DecodeResult | None
    error: BaseException | None
    seed: int | None  # config.seed, or the one drawn at start (re-run with it to reproduce)
    seconds: float  # from the start of `decode_lockstep` until this request finished


@dataclass
class LockstepReport:
    """What one call shared: iterations of the loop and model forwards of each side."""

    iterations: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0


class _Loops:
    """The requests' decode loops and the side call each one waits on."""

    def __init__(
        self,
        requests: list[Request],
        vocab: int,
        has_draft: bool,
        start: float,
        clock: Callable[[], float],
        controller: ControllerFactory | None,
    ) -> None:
        self.out = [RequestResult(None, None, None, 0.0) for _ in requests]
        self.loops: dict[int, Generator[SideCall, Any, list[DecodeResult]]] = {}
        self.waiting: dict[int, SideCall] = {}
        self.start, self.clock = start, clock
        for i, request in enumerate(requests):
            try:
                config = method_config(request.method, request.config)
                if config.uses_draft and not has_draft:
                    raise ValueError(
                        f"method={request.method!r} needs a draft model; none was given"
                    )
                chosen = controller(request, config) if controller else None
                decode = Decode(
                    config,
                    vocab,
                    [list(request.prompt_ids)],
                    controller=chosen,
                    stop=request.stop,
                )
                self.out[i].seed = decode.state.seed
                self.loops[i] = decode.steps()
                self.send(i, None)
            except Exception as error:  # a bad request fails alone
                self.fail(i, error)

    def send(self, i: int, answer: Any) -> None:
        """Give loop `i` its answer; note its next side call, or its result."""
        try:
            self.waiting[i] = self.loops[i].send(answer)
        except StopIteration as stop:
            self.out[i].result = stop.value[0]
            self.out[i].seconds = self.clock() - self.start
            self._drop(i)
        except Exception as error:
            self.fail(i, error)

    def fail(self, i: int, error: BaseException) -> None:
        self.out[i].error, self.out[i].seconds = error, self.clock() - self.start
        self._drop(i)

    def _drop(self, i: int) -> None:
        self.waiting.pop(i, None)
        loop = self.loops.pop(i, None)
        if loop is not None:
            loop.close()

    def asking(self, kind: type) -> list[int]:
        return [i for i, call in self.waiting.items() if isinstance(call, kind)]

    def answer(self, members: list[int], values: list[Any]) -> None:
        for i, value in zip(members, values, strict=True):
            if isinstance(value, BaseException):
                self.fail(i, value)
            else:
                self.send(i, value)


def decode_lockstep(
    requests: list[Request],
    target: SessionBatcher,
    draft: SessionBatcher | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
    controller: ControllerFactory | None = None,
) -> tuple[list[RequestResult], LockstepReport]:
    """Decode every request to its end, sharing each iteration's forwards; one result each.

    `controller(request, its method's config)` gives each request its knob
    controller (None, or no factory: the request's own gamma and W_S every iteration)."""
    key_prefix = uuid.uuid4().hex  # batchers may hold other calls' sessions: keys must not clash
    vocab = target.scorer.vocab_size
    loops = _Loops(requests, vocab, draft is not None, clock(), clock, controller)
    report = LockstepReport()

    def key(i: int) -> str:
        return f"{key_prefix}-{i}"

    try:
        while loops.waiting:
            report.iterations += 1
            proposing = loops.asking(Propose)
            if proposing:
                assert draft is not None
                values, batch = draft.run(
                    [Job(key(i), loops.waiting[i].call.propose_steps(vocab)) for i in proposing]
                )
                report.draft_forwards += batch.forwards
                loops.answer(proposing, values)
            verifying = loops.asking(Verify)
            if not verifying:
                continue
            jobs = []
            for i in verifying:
                call = loops.waiting[i]
                assert isinstance(call, Verify)
                jobs.append(Job(key(i), call.call.verify_steps(vocab, call.forest)))
            values, batch = target.run(jobs)
            report.target_forwards += batch.forwards
            loops.answer(verifying, values)
    finally:
        for i in range(len(requests)):
            target.release(key(i))
            if draft is not None:
                draft.release(key(i))
    return loops.out, report
