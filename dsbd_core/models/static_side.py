"""The static path's forwards inside a side's graph (`side_graphs.draft_side`, `verify_side`).

A side's graph runs its model's forwards inside it, so nothing in them may read a value on the
host, run an operation on a host tensor, or depend on a number that changes every iteration
(Dynamo guards on every Python number a traced function reads: a new value is a new graph).
The slot layout (`slot_layout.plan_slots`) reads nothing, but it takes a session's cached
columns and length as host numbers, sizes its mask by them and records on the host. Here the
same layout, the same bucket and the same step are built from device tensors instead:

* before the side (`SideSessions.prepare`, eagerly, after the iteration's one read): the
  scorer's `set_roots` (each session's rows compacted in the pool), then one copy to the
  device of what each session's forwards need (cached columns, root length, the root tokens
  not yet fed, each root's local row), and the pool grown to hold the side's columns;
* inside the side (`SideSessions.forward`): each forward's inputs as device operations on
  those tensors, the mask over the whole pool row (the pool's width, not the session's), the
  bucket of the ladder the eager path would run, the step function itself
  (`static_step.step_function`, traced into the side's graph: captured with the side, not
  replayed bucket by bucket), the log-probs gathered out;
* after the side (`SideSessions.finish`, eagerly, host numbers only): what each session's
  columns now hold (`slot_layout.record_slots`' bookkeeping), for the next compaction.

Same inputs, bucket and step as the slot layout's eager forward, so the same log-probs, bit for
bit (tests/models/test_static_side.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsbd_core.algorithm.scorer import ForestLayer
from dsbd_core.models.kv_cache import NODE_COLUMN, SessionCache, SlotPlacement
from dsbd_core.models.static_cache import SlotHandle, StaticKV, to_device
from dsbd_core.models.static_step import SLOT_BUCKETS, bucket, idle_inputs, row_buckets

# A session whose root tokens not yet fed exceed this (a re-prefill after an eviction) makes
# the side run eagerly: its forward would be a new shape, a new graph, for one iteration.
MAX_UNCACHED = 4


@dataclass
class SideSession:
    """What one session's forwards in a side need, on the device, and what they fed.

    Every forward covers all `count` rows the session holds in the pool, not only its `n`
    alive ones (the others are padding: they see only themselves and their outputs are never
    read), so beams that end or join change no shape. meta: [2] long on the device: the cached
    columns and the root length at the side's start. tail: [count, uncached] long on the
    device: the root tokens not yet fed (the side's first forward feeds them).
    local_of_root: [roots] long on the device: each root's local row, -1 for a root without
    one. The host numbers the graph sees (b, base, count, uncached) stay the same from one
    iteration to the next in a steady decode, so the side's graph is captured once.
    """

    b: int
    base: int
    count: int
    n: int  # alive rows: the host's bookkeeping only, never read inside the graph
    uncached: int
    meta: torch.Tensor
    tail: torch.Tensor
    local_of_root: torch.Tensor
    fed: int = 0  # slots fed in this side so far (each forward's columns follow)
    # per forward of the side: its uncached tokens and layer widths (host numbers), and each
    # fed layer's rows and ancestors (device tensors, the next layer's parents need them)
    calls: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    placed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class SideSessions:
    """A side's sessions on the static path (module docstring)."""

    def __init__(self, pool: StaticKV, step, sessions: list[SideSession], root_count: int) -> None:  # noqa: ANN001 (the step function)
        self.pool = pool
        self.step = step
        self.sessions = sessions
        self.root_count = root_count

    @staticmethod
    def prepare(
        pool: StaticKV,
        step,
        sessions: Sequence[SessionCache | None],
        root_count: int,  # noqa: ANN001
    ) -> SideSessions | None:
        """The side's device metadata in one copy, or None where a session would make a new
        shape (`MAX_UNCACHED`). The pool must already hold the side's columns."""
        device = pool.device
        host, shapes = [], []
        for b, session in enumerate(sessions):
            if session is None:
                continue
            uncached = session.length - session.prefix_cols
            if uncached > MAX_UNCACHED or not isinstance(session.cache, SlotHandle):
                return None
            n, count = session.rows.numel(), session.cache.count
            local = torch.full((root_count,), -1, dtype=torch.long)
            local[session.rows] = torch.arange(n)
            meta = torch.tensor([session.cached_cols, session.length], dtype=torch.long)
            tail = torch.zeros(count, uncached, dtype=torch.long)
            tail[:n] = session.tokens[:, session.prefix_cols :]
            host += [meta, tail.reshape(-1), local]
            shapes.append((b, session, uncached))
        if not shapes:
            return None
        flat = to_device(torch.cat(host), device)
        parts = iter(flat.split([x.numel() for x in host]))
        side = []
        for b, session, uncached in shapes:
            meta, tail, local = (next(parts) for _ in range(3))
            handle = session.cache
            assert isinstance(handle, SlotHandle)
            count = handle.count
            side.append(
                SideSession(
                    b,
                    handle.base,
                    count,
                    session.rows.numel(),
                    uncached,
                    meta,
                    tail.view(count, uncached),
                    local,
                )
            )
        return SideSessions(pool, step, side, root_count)

    def forward(
        self,
        layers: Sequence[ForestLayer],
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """One bucketed forward of every session over its untaken root tokens (the side's
        first forward) and `layers`: log-probs written into `roots` / `outs` on the device."""
        pool = self.pool
        columns = pool.length + pool.scratch
        widths = tuple(layer.token.shape[1] for layer in layers)
        plans = []
        for side in self.sessions:
            uncached = side.uncached if not side.calls else 0
            if uncached + sum(widths) > 0:
                plans.append((side, uncached, _plan(side, layers, uncached, widths, columns)))
        if not plans:
            return
        q_max = max(plan[0].shape[1] for _, _, plan in plans)
        slots = bucket(q_max, SLOT_BUCKETS) or q_max
        top = max(side.base + side.count for side, _, _ in plans)
        rows = bucket(top, row_buckets(pool.rows)) or top
        inputs = idle_inputs(pool, rows, slots)
        span = torch.arange(slots, device=pool.device)
        for side, _, (input_ids, position_ids, allowed, _) in plans:
            block = slice(side.base, side.base + side.count)
            q = input_ids.shape[1]
            start = side.meta[0] + side.fed
            inputs.input_ids[block] = 0
            inputs.input_ids[block, :q] = input_ids
            inputs.position_ids[block] = 0
            inputs.position_ids[block, :q] = position_ids
            inputs.write[block] = start + span  # padding slots write past the session's columns
            inputs.allowed[block] = False
            inputs.allowed[block, :q] = allowed
            if slots > q:  # a padding slot sees itself
                inputs.allowed[block, span[q:], start + span[q:]] = True
        logprobs = self.step(inputs.input_ids, inputs.position_ids, inputs.write, inputs.allowed, 0)
        for side, uncached, (input_ids, _, _, placed) in plans:
            _gather(side, uncached, widths, placed, logprobs, roots, outs)
            side.calls.append((uncached, widths))
            side.placed.extend(placed)
            side.fed += input_ids.shape[1]

    def finish(self, sessions: Sequence[SessionCache | None]) -> None:
        """Record on the host what the side's forwards appended to each session's columns:
        the root tokens fed, then node columns (`kv_cache.NODE_COLUMN`) whose tokens the
        compaction takes from the accepted beams; the layers' placements."""
        for side in self.sessions:
            session = sessions[side.b]
            assert session is not None
            placed = iter(side.placed)
            for uncached, widths in side.calls:
                first = session.cached_cols + uncached
                fed = torch.full((side.n, uncached + sum(widths)), NODE_COLUMN, dtype=torch.long)
                fed[:, :uncached] = session.tokens[:, session.prefix_cols :]
                session.column_tokens = torch.cat([session.column_tokens, fed], dim=1)
                session.prefix_cols = session.length
                for width in widths:
                    row, ancestors = next(placed)
                    session.layers.append(SlotPlacement(row, ancestors, first, width))
                    first += width
            self.pool.touch(side.base)


def _plan(
    side: SideSession,
    layers: Sequence[ForestLayer],
    uncached: int,
    widths: tuple[int, ...],
    columns: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`slot_layout.plan_slots` on device tensors: input ids, positions [n, q], the mask
    [n, q, columns] over the whole pool row, and each layer's (row, ancestors)."""
    device = side.meta.device
    n = side.count
    start, length = side.meta[0] + side.fed, side.meta[1]
    q = uncached + sum(widths)
    span = torch.arange(q, device=device)
    every = torch.arange(columns, device=device)
    input_ids = torch.zeros(n, q, dtype=torch.long, device=device)
    position_ids = torch.zeros(n, q, dtype=torch.long, device=device)
    allowed = (every[None, :] == (start + span)[:, None]).expand(n, q, columns).clone()
    if uncached > 0:  # the tail: its columns follow the cached ones, all of them root tokens
        input_ids[:, :uncached] = side.tail
        position_ids[:, :uncached] = start + span[:uncached]
        allowed[:, :uncached] = every[None, :] <= (start + span[:uncached])[:, None]
    prefix = every < length  # the whole root prefix
    row_ids = torch.arange(n, device=device)
    previous = side.placed[-1] if side.placed else None
    depth0 = len(side.placed)
    placed = []
    offset = uncached
    for j, layer in enumerate(layers):
        width = widths[j]
        parent, exists = layer.parent[side.b], layer.exists[side.b]
        column = start + offset + torch.arange(width, device=device)
        if depth0 + j == 0:
            row = side.local_of_root[parent.clamp(0, side.local_of_root.numel() - 1)]
            ancestors = column[:, None]
        else:
            if previous is None:
                raise ValueError(f"layer {depth0 + j + 1} given before layer {depth0 + j}")
            before_row, before_ancestors = previous
            safe = parent.clamp(0, before_row.numel() - 1)
            row = before_row[safe]
            ancestors = torch.cat([before_ancestors[safe], column[:, None]], dim=1)
        row = torch.where(exists, row, -1)
        real = row[None, :] == row_ids[:, None]  # [n, M]: the node is real in this row
        seen = torch.zeros(width, columns, dtype=torch.bool, device=device)
        seen.scatter_(1, ancestors.clamp(min=0), True)
        slots = slice(offset, offset + width)
        allowed[:, slots] |= real[:, :, None] & (prefix[None, None, :] | seen[None])
        input_ids[:, slots] = layer.token[side.b][None, :]
        position_ids[:, slots] = length - 1 + depth0 + j + 1
        placed.append((row, ancestors))
        previous = (row, ancestors)
        offset += width
    return input_ids, position_ids, allowed, placed


def _gather(
    side: SideSession,
    uncached: int,
    widths: tuple[int, ...],
    placed: list[tuple[torch.Tensor, torch.Tensor]],
    logprobs: torch.Tensor,
    roots: torch.Tensor | None,
    outs: list[torch.Tensor],
) -> None:
    """`slot_layout.gather_outputs` for one session of the bucket (its rows from `base`)."""
    device = logprobs.device
    if uncached > 0 and roots is not None:  # each root's row, by root: no count of alive rows
        local = side.local_of_root
        values = logprobs[side.base + local.clamp(min=0), uncached - 1].to(roots.dtype)
        roots[side.b] = torch.where((local >= 0)[:, None], values, roots.new_zeros(()))
    start = uncached
    for out, (row, _), width in zip(outs, placed, widths, strict=True):
        slot = start + torch.arange(width, device=device)
        values = logprobs[side.base + row.clamp(min=0), slot].to(out.dtype)
        out[side.b] = torch.where((row >= 0)[:, None], values, out.new_zeros(()))
        start += width
