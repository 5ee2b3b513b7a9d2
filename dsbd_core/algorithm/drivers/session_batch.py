"""Many decode requests, one model forward: how a serving replica batches across requests.

Every request's iteration side (`Engine.propose_steps` on the draft, `Engine.verify_steps` on the
target) is a generator of `ScoreCall`s. `SessionBatcher.run` advances the generators of all the
requests in a batch in lockstep and answers each round of calls with ONE forward of the shared
scorer: the requests' roots and forest layers are stacked along the batch axis, right-padded
(dead rows, non-existing nodes, which the scorer feeds nothing for) and split back afterwards.
Requests with different widths, depths and sampling configs batch together, because only the
model forward is shared; each request's sampling and verification run in its own generator,
with its own config and random stream, exactly as in-process.

KV caches stay here between iterations, keyed by the request's session id, and go back to the
scorer in the order of the next batch. A missing cache (first iteration, another replica, an
eviction) costs a re-prefill from the token ids the call carries, never a wrong result; for an
exact job (a seeded request, `dsbd_core.algorithm.drivers.replay`) it costs a replay of the
session's past iterations instead, which rebuilds the cache bit for bit. Entries
are dropped on `release`, when a job fails, after `ttl_s` without use, and least-recently-used
beyond `max_sessions`. A scorer that keeps the caches itself and exports only handles (the
tensor-parallel `ShardedScorer`: the shards stay on the ranks) is told of every dropped entry
through its optional `discard_sessions`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dsbd_core.algorithm.scorer import (
    ForestLayer,
    ForestLogprobs,
    ForestScorer,
    Origin,
    Roots,
    ScoreCall,
)


class SessionScorer(ForestScorer, Protocol):
    """A scorer whose per-session caches can be taken out and put back (TransformerScorer)."""

    def export_sessions(self) -> list[Any]: ...

    def import_sessions(self, sessions: list[Any]) -> None: ...


def _discard(scorer: Any, sessions: list[Any]) -> None:
    """Tell a handle-exporting scorer that these sessions are gone (no-op for the others)."""
    discard = getattr(scorer, "discard_sessions", None)
    if discard is not None and any(s is not None for s in sessions):
        discard(sessions)


class ReplayNeeded(RuntimeError):
    """An exact job found no cache of its session's previous iteration here and came without
    the history to rebuild it: the caller sends the call again with its history."""


@dataclass
class PastStep:
    """One earlier iteration of a job's session on this side, re-run to rebuild a lost cache."""

    iteration: int
    after: int | None  # the iteration whose cache it continued (None: it started the cache)
    steps: Callable[[], Generator[ScoreCall, ForestLogprobs, Any]]


@dataclass
class Job:
    """One request's side of an iteration: its session id and its step generator.

    A tracked job (`iteration` set) uses a stored cache only if that cache was left by the
    side's call of iteration `after` (not a later one: a retried iteration whose first attempt
    already ran here). An `exact` job may not re-prefill a cache it lacks, since a cache built
    in one forward holds other last bits than one built iteration by iteration: it replays its
    `history`, or fails with `ReplayNeeded` when none came with it.
    """

    key: str
    steps: Generator[ScoreCall, ForestLogprobs, Any]
    iteration: int | None = None  # the decode iteration it runs (tags the cache it leaves)
    after: int | None = None  # the iteration whose cache it continues (None: starts one)
    exact: bool = False
    history: list[PastStep] | None = None  # this side's earlier iterations, oldest first


@dataclass
class BatchReport:
    """What one `run` did: how many requests shared each forward, and how many forwards."""

    requests: int = 0  # jobs that reached the model in this batch
    sessions: int = 0  # scorer batch rows (sum of the jobs' sessions)
    forwards: int = 0  # model forwards (one per lockstep round)
    reused: int = 0  # jobs whose cache was found here (the others re-prefilled or replayed)
    replayed: dict[str, int] = field(default_factory=dict)  # key -> past iterations re-run


@dataclass
class _Entry:
    sessions: list[Any]
    used: float
    iteration: int | None = None  # the iteration of the job that left it (tracked jobs)


@dataclass
class SessionBatcher:
    """Drives the step generators of concurrent requests against one scorer, one forward a round.

    Not thread-safe: a replica runs one batch at a time (Ray Serve's `@serve.batch` does).
    """

    scorer: SessionScorer
    ttl_s: float = 600.0
    max_sessions: int = 256
    clock: Callable[[], float] = time.monotonic
    _store: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)

    def run(self, jobs: list[Job]) -> tuple[list[Any], BatchReport]:
        """Run every job to its end; returns each job's value (or the exception it raised)."""
        self.expire()
        report = BatchReport()
        results: list[Any] = [None] * len(jobs)
        calls = self._first_calls(jobs, results)
        self._rebuild(jobs, calls, results, report)
        members = sorted(calls)  # jobs that need the model, in batch order
        if not members:
            return results, report
        roots = [calls[i].roots for i in members]
        sizes = [r.tokens.shape[0] for r in roots]  # type: ignore[union-attr]  # a first call carries its roots
        widths = [r.tokens.shape[1] for r in roots]  # type: ignore[union-attr]  # a first call carries its roots
        cached = self._take_caches(jobs, members, roots, sizes, report)  # type: ignore[arg-type]  # a first call carries its roots
        report.requests, report.sessions = len(members), sum(sizes)
        failed: set[int] = set()
        try:
            self.scorer.import_sessions(cached)
            self.scorer.set_roots(_stack_roots(roots))  # type: ignore[arg-type]  # a first call carries its roots
            self._rounds(jobs, members, sizes, widths, calls, results, failed, report)
        except Exception as error:  # the shared forward failed: every job of the batch fails
            for i in members:
                if results[i] is None or i in calls:
                    results[i] = error
            failed.update(members)
        self._keep_caches(jobs, members, sizes, failed)
        return results, report

    def _first_calls(self, jobs: list[Job], results: list[Any]) -> dict[int, ScoreCall]:
        """Each job's first call, which must carry its roots; a job that fails here fails alone
        (its cache is freed)."""
        calls: dict[int, ScoreCall] = {}
        for i, job in enumerate(jobs):
            self._step(i, job, None, calls, results)
            if i in calls and calls[i].roots is None:
                calls.pop(i)
                results[i] = RuntimeError("a step generator's first call must carry roots")
            if isinstance(results[i], BaseException):
                self.release(job.key)
        return calls

    def _take_caches(
        self,
        jobs: list[Job],
        members: list[int],
        roots: list[Roots],
        sizes: list[int],
        report: BatchReport,
    ) -> list[Any]:
        """The members' stored caches in batch order (None where a job re-prefills: a fresh
        session, a cache of another shape, or none here)."""
        cached: list[Any] = []
        for i, root, size in zip(members, roots, sizes, strict=True):
            job, entry = jobs[i], self._store.pop(jobs[i].key, None)
            usable = entry is not None and root.origin is not None and len(entry.sessions) == size
            if job.iteration is not None:  # tracked: only the cache its previous call left
                usable = usable and job.after is not None and entry.iteration == job.after  # type: ignore[union-attr]  # usable: there is an entry
            report.reused += int(usable and job.key not in report.replayed)
            if entry is not None and not usable:
                _discard(self.scorer, entry.sessions)
            cached += entry.sessions if usable else [None] * size  # type: ignore[union-attr]  # usable: there is an entry
        return cached

    def _rounds(
        self,
        jobs: list[Job],
        members: list[int],
        sizes: list[int],
        widths: list[int],
        calls: dict[int, ScoreCall],
        results: list[Any],
        failed: set[int],
        report: BatchReport,
    ) -> None:
        """Answer the jobs' calls with one forward a round until every job has its value."""
        first = True
        while calls:
            layers = [calls[i].layers if i in calls else [] for i in members]
            scored = self.scorer.forward(_stack_layers(layers, sizes))
            report.forwards += 1
            start = 0
            for i, size, width, own in zip(members, sizes, widths, layers, strict=True):
                part = _split(scored, start, size, width if first else None, own)
                start += size
                if i not in calls:
                    continue
                calls.pop(i)
                self._step(i, jobs[i], part, calls, results)
                if isinstance(results[i], BaseException):
                    failed.add(i)
                elif i in calls and calls[i].roots is not None:
                    calls.pop(i)
                    failed.add(i)
                    results[i] = RuntimeError("set_roots twice in one iteration")
            first = False

    def _keep_caches(
        self, jobs: list[Job], members: list[int], sizes: list[int], failed: set[int]
    ) -> None:
        """Store the caches of the jobs that succeeded under their keys; drop the others."""
        sessions = self.scorer.export_sessions()
        start = 0
        now = self.clock()
        complete = len(sessions) == sum(sizes)
        for i, size in zip(members, sizes, strict=True):
            if i not in failed and complete:
                self._store[jobs[i].key] = _Entry(
                    sessions[start : start + size], now, jobs[i].iteration
                )
            elif complete:
                _discard(self.scorer, sessions[start : start + size])
            start += size
        if not complete:
            _discard(self.scorer, sessions)
        self._evict()

    def _rebuild(
        self,
        jobs: list[Job],
        calls: dict[int, ScoreCall],
        results: list[Any],
        report: BatchReport,
    ) -> None:
        """Rebuild the lost caches of exact jobs by re-running their sessions' past iterations
        (each round one batch of every job still replaying: batch mates change no bits), or
        fail a job that came without its history with `ReplayNeeded`."""
        lost = []
        for i in sorted(calls):
            job = jobs[i]
            entry = self._store.get(job.key)
            if not job.exact or job.after is None or (entry and entry.iteration == job.after):
                continue
            if job.history is None:
                _fail(
                    i,
                    jobs,
                    calls,
                    results,
                    ReplayNeeded(
                        f"session {job.key!r}: no cache of iteration {job.after} on this replica; "
                        "send the call again with its history to rebuild it"
                    ),
                )
            else:
                lost.append(i)
        for r in range(max((len(jobs[i].history or []) for i in lost), default=0)):
            now = [i for i in lost if i in calls and r < len(jobs[i].history or [])]
            past = [jobs[i].history[r] for i in now]  # type: ignore[index]  # r < len(history): it has one
            values, _ = self.run(
                [
                    Job(jobs[i].key, p.steps(), p.iteration, p.after)
                    for i, p in zip(now, past, strict=True)
                ]
            )
            for i, value in zip(now, values, strict=True):
                if isinstance(value, BaseException):  # fails alone, its cache freed
                    _fail(i, jobs, calls, results, value)
                    self.release(jobs[i].key)
                else:
                    report.replayed[jobs[i].key] = r + 1
        for i in lost:
            entry = self._store.get(jobs[i].key)
            if i in calls and (entry is None or entry.iteration != jobs[i].after):
                _fail(
                    i,
                    jobs,
                    calls,
                    results,
                    RuntimeError(
                        f"session {jobs[i].key!r}: its history does not end at iteration "
                        f"{jobs[i].after}"
                    ),
                )

    def release(self, key: str) -> bool:
        """Free a session's caches (request finished, failed or cancelled)."""
        entry = self._store.pop(key, None)
        if entry is not None:
            _discard(self.scorer, entry.sessions)
        return entry is not None

    def expire(self) -> list[str]:
        """Drop caches unused for `ttl_s`; returns their keys."""
        limit = self.clock() - self.ttl_s
        stale = [key for key, entry in self._store.items() if entry.used < limit]
        for key in stale:
            _discard(self.scorer, self._store.pop(key).sessions)
        return stale

    @property
    def cached(self) -> list[str]:
        """Session ids with a cache here, least recently used first."""
        return list(self._store)

    def _evict(self) -> None:
        while len(self._store) > self.max_sessions:
            _discard(self.scorer, self._store.popitem(last=False)[1].sessions)

    @staticmethod
    def _step(
        i: int,
        job: Job,
        answer: ForestLogprobs | None,
        calls: dict[int, ScoreCall],
        results: list[Any],
    ) -> None:
        """Advance one generator: its next call, or its value / exception in `results`."""
        try:
            calls[i] = next(job.steps) if answer is None else job.steps.send(answer)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as error:  # a bad request fails alone, not its batch
            results[i] = error


def _fail(
    i: int, jobs: list[Job], calls: dict[int, ScoreCall], results: list[Any], error: BaseException
) -> None:
    """Job `i` fails before its batch's forward: its call withdrawn, its generator closed."""
    calls.pop(i)
    jobs[i].steps.close()
    results[i] = error


def _pad(x: torch.Tensor, shape: tuple[int, ...], value: int | bool | float) -> torch.Tensor:
    """Right-pad every dimension of `x` to `shape`."""
    out = x.new_full(shape, value)
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def _stack_roots(parts: list[Roots]) -> Roots:
    """Roots of several jobs as one batch: rows padded to the widest, tokens to the longest."""
    rows = max(p.tokens.shape[1] for p in parts)
    cols = max(p.tokens.shape[2] for p in parts)
    tokens = torch.cat([_pad(p.tokens, (p.tokens.shape[0], rows, cols), 0) for p in parts])
    alive = torch.cat([_pad(p.alive, (p.alive.shape[0], rows), False) for p in parts])
    lengths = torch.cat([p.lengths for p in parts])
    if all(p.origin is None for p in parts):
        return Roots(tokens, lengths, alive, None)
    depth = max(p.origin.path.shape[2] for p in parts if p.origin is not None)
    roots, paths = [], []
    for p in parts:
        batch = p.tokens.shape[0]
        if p.origin is None:  # a fresh session: its (absent) cache is never compacted
            roots.append(torch.zeros(batch, rows, dtype=torch.long))
            paths.append(torch.full((batch, rows, depth), -1, dtype=torch.long))
        else:
            roots.append(_pad(p.origin.root, (batch, rows), 0))
            paths.append(_pad(p.origin.path, (batch, rows, depth), -1))
    return Roots(tokens, lengths, alive, Origin(torch.cat(roots), torch.cat(paths)))


def _stack_layers(layers: list[list[ForestLayer]], sizes: list[int]) -> list[ForestLayer]:
    """The jobs' layers of one round as batch layers; a job with fewer layers gets empty ones."""
    count = max((len(own) for own in layers), default=0)
    stacked = []
    for depth in range(count):
        nodes = max((own[depth].token.shape[1] for own in layers if depth < len(own)), default=1)
        parent, token, exists = [], [], []
        for own, size in zip(layers, sizes, strict=True):
            if depth < len(own):
                layer = own[depth]
                parent.append(_pad(layer.parent, (size, nodes), 0))
                token.append(_pad(layer.token, (size, nodes), 0))
                exists.append(_pad(layer.exists, (size, nodes), False))
            else:
                parent.append(torch.zeros(size, nodes, dtype=torch.long))
                token.append(torch.zeros(size, nodes, dtype=torch.long))
                exists.append(torch.zeros(size, nodes, dtype=torch.bool))
        stacked.append(ForestLayer(torch.cat(parent), torch.cat(token), torch.cat(exists)))
    return stacked


def _split(
    scored: ForestLogprobs, start: int, size: int, width: int | None, own: list[ForestLayer]
) -> ForestLogprobs:
    """One job's part of a batched forward's output, in its own shapes (`width`: its roots)."""
    rows = slice(start, start + size)
    roots = None
    if width is not None and scored.roots is not None:
        roots = scored.roots[rows, :width]
    layers = [out[rows, : x.token.shape[1]] for out, x in zip(scored.layers, own, strict=False)]
    return ForestLogprobs(roots=roots, layers=layers, support=scored.support)
