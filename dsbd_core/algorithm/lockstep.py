"""Decode many independent requests together: each its own method, config and seed; shared forwards.

`generate_batch` decodes several prompts with ONE config and ONE random stream (the prompts are
rows of one engine state), so a prompt's result depends on its batch mates. A batch job needs
every row to be reproducible on its own: its own method, knobs and seed. Here every request
keeps its own `Engine` and `DecodeState` (its random streams are seeded by (seed, iteration,
side)), and only the model forwards are shared: each iteration the draft sides of all live
requests run as one `SessionBatcher` batch on the draft model, then their target sides as one
batch on the target. That is what the serving replicas do across processes; here it is one loop
in one process, and a request decodes exactly what `generate` decodes for it alone
(tests/test_batch.py checks it draw for draw in float64).

A request that cannot start (bad prompt, a draft method without a draft) or whose step fails
gets its error back; the others go on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.decoders import METHODS_WITH_DRAFT, method_config
from dsbd_core.algorithm.engine import DecodeState, Engine, Forest
from dsbd_core.algorithm.result import DecodeResult
from dsbd_core.algorithm.scorer import RemoteModel
from dsbd_core.algorithm.session_batch import Job, SessionBatcher

_NO_FOREST = Forest([], [], [])  # what a method without a draft verifies (beam, sample)


@dataclass(frozen=True)
class Request:
    """One decode: prompt ids, the config as given, and the method that maps it (decoders.py)."""

    prompt_ids: list[int]
    config: SamplingConfig
    method: str = "dsbd"


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


def decode_lockstep(
    requests: list[Request],
    target: SessionBatcher,
    draft: SessionBatcher | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestResult], LockstepReport]:
    """Decode every request to its end, sharing each iteration's forwards; one result each."""
    start = clock()
    key_prefix = uuid.uuid4().hex  # batchers may hold other calls' sessions: keys must not clash
    remote = RemoteModel(target.scorer.vocab_size)
    out = [RequestResult(None, None, None, 0.0) for _ in requests]
    engines: dict[int, Engine] = {}
    states: dict[int, DecodeState] = {}
    for i, request in enumerate(requests):
        try:
            config = method_config(request.method, request.config)
            uses_draft = request.method in METHODS_WITH_DRAFT
            if uses_draft and draft is None:
                raise ValueError(f"method={request.method!r} needs a draft model; none was given")
            engine = Engine(remote, config, remote if uses_draft else None)
            states[i] = engine.start([list(request.prompt_ids)])
            engines[i] = engine
            out[i].seed = states[i].seed
        except Exception as error:  # a bad request fails alone
            out[i].error, out[i].seconds = error, clock() - start
    report = LockstepReport()

    def key(i: int) -> str:
        return f"{key_prefix}-{i}"

    def fail(i: int, error: BaseException) -> None:
        out[i].error, out[i].seconds = error, clock() - start
        engines.pop(i)

    try:
        while engines:
            live = []
            for i in list(engines):
                if engines[i].next_iteration(states[i]):
                    live.append(i)
                else:
                    out[i].result = engines.pop(i).finish(states[i])[0]
                    out[i].seconds = clock() - start
            if not live:
                break
            report.iterations += 1
            messages = {i: states[i].for_models() for i in live}
            forests: dict[int, Forest] = {}
            drafting = [i for i in live if engines[i].draft is not None]
            if drafting:
                assert draft is not None
                values, batch = draft.run(
                    [Job(key(i), engines[i].propose_steps(messages[i])) for i in drafting]
                )
                report.draft_forwards += batch.forwards
                for i, value in zip(drafting, values, strict=True):
                    if isinstance(value, BaseException):
                        fail(i, value)
                    else:
                        forests[i] = value
            verifying = [i for i in live if i in engines]
            jobs = [
                Job(key(i), engines[i].verify_steps(messages[i], forests.get(i, _NO_FOREST)))
                for i in verifying
            ]
            values, batch = target.run(jobs)
            report.target_forwards += batch.forwards
            for i, value in zip(verifying, values, strict=True):
                if isinstance(value, BaseException):
                    fail(i, value)
                else:
                    engines[i].advance(states[i], value)
    finally:
        for i in range(len(requests)):
            target.release(key(i))
            if draft is not None:
                draft.release(key(i))
    return out, report
