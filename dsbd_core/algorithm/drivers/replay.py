"""Rebuild a lost KV cache bit for bit: re-run the session's past iterations, not one prefill.

Why: a cache built iteration by iteration and one re-prefilled in a single forward hold other
last bits (bfloat16, int8 and float32 alike: other matmul shapes, other reduction orders), so a
seeded request whose cache died with its replica could draw other tokens than it draws
in-process (docs/history/RELIABILITY-chronicle.md §11: 18 of 73 re-prefilled requests in the chaos
run). A
session's forwards are deterministic functions of their inputs and, batch-invariant
(`dsbd_core.models.row_chunks`), of nothing else: re-running the session's own iterations in
order (each one's roots, compaction and forest, alone or batched with any others) rebuilds
exactly the cache it had.

The driver keeps a `Lineage` per seeded decode: each finished iteration's call (the state the
models saw, its knobs) and the skeleton of the forest the target scored (parents and tokens,
which the verify reply brings back: the driver never holds the forest itself). Every call it
sends carries a `Replay`: which earlier iteration each side's cache must come from, and, only
after a replica asked for it (`ReplayNeeded`) or was lost, the history. A replica whose cache
is missing or from another iteration replays (`SessionBatcher._rebuild`): the draft re-runs
its past `propose_steps` (the same seeded streams on the same logits draw the same forests),
the target re-scores each past forest (the first call of its `verify_steps`); their outputs
are dropped, only the caches are kept.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from dsbd_core.algorithm.drivers.loop import IterationCall, PastIteration, Replay
from dsbd_core.algorithm.drivers.session_batch import Job, PastStep, ReplayNeeded
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.sequences.state import Forest

__all__ = ["Lineage", "PastIteration", "Replay", "ReplayNeeded", "draft_job", "verify_job"]


@dataclass
class Lineage:
    """A seeded decode's finished iterations, kept by its driver (the serving router)."""

    past: list[PastIteration] = field(default_factory=list)

    def tag(self, call: IterationCall, *, history: bool) -> IterationCall:
        """`call` as sent: with the iteration each side continues, and the history if asked."""
        last = next((p.call.state.iteration for p in reversed(self.past) if p.drafted), None)
        return replace(call, replay=Replay(last, list(self.past) if history else None))

    def record(self, call: IterationCall, *, drafted: bool, layers: list[ForestLayer]) -> None:
        """Keep a finished iteration (call as built, before `tag`)."""
        self.past.append(PastIteration(replace(call, trace={}, replay=None), drafted, layers))


def draft_job(key: str, call: IterationCall, vocab: int) -> Job:
    """The draft side of `call` as a batch job; exact (replays) when the call carries `Replay`."""
    steps = call.propose_steps(vocab)
    if call.replay is None:
        return Job(key, steps)
    history = None
    if call.replay.history is not None:
        history, after = [], None
        for past in call.replay.history:
            if past.drafted:
                iteration = past.call.state.iteration
                history.append(PastStep(iteration, after, partial(past.call.propose_steps, vocab)))
                after = iteration
    return Job(key, steps, call.state.iteration, call.replay.last_drafted, True, history)


def verify_job(key: str, call: IterationCall, forest: Forest, vocab: int) -> Job:
    """The target side of `call` on `forest` as a batch job; exact when the call carries
    `Replay` (the target runs every iteration: its cache continues the previous one)."""
    steps = call.verify_steps(vocab, forest)
    if call.replay is None:
        return Job(key, steps)
    history = None
    if call.replay.history is not None:
        history = [
            PastStep(
                p.call.state.iteration,
                p.call.state.iteration - 1 if n else None,
                partial(_scoring, p, vocab),
            )
            for n, p in enumerate(call.replay.history)
        ]
    iteration = call.state.iteration
    return Job(key, steps, iteration, iteration - 1 if iteration else None, True, history)


def _scoring(past: PastIteration, vocab: int) -> Generator[ScoreCall, ForestLogprobs, Any]:
    """A past iteration's target forward only: the first call of its `verify_steps` (the one
    that scores the forest; verification needs the draft's tables, which are gone)."""
    steps = past.call.verify_steps(vocab, Forest(past.layers, [], []))
    try:
        yield next(steps)
    finally:
        steps.close()
