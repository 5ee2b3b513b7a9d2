"""A preallocated KV cache for the static-shape decode path: one pool of rows, written in place.

Captured graphs (CUDA graphs, `torch.compile(mode="reduce-overhead")`) replay fixed kernels on
fixed addresses, so the cache cannot grow by concatenation as `DynamicCache` does. The pool is
one tensor `[layers, 2 (keys, values), rows, kv_heads, length, head_dim]`, allocated once
(marked as a static address on CUDA) and grown only when a session needs more rows or columns
than it has (a new allocation: graphs captured over the old one are dropped and captured again).

A session holds a `SlotHandle`: `count` consecutive rows from `base`, one per beam (tree) of
the session, its columns laid out exactly as the dynamic path lays them (column j of a row =
the j-th token fed to that row), so the compaction plan of `kv_cache.plan_compaction` applies
unchanged: accepting a layer is a row gather (parents) and a column gather (the accepted path)
inside the pool, with no allocation of the cache itself.

The last `scratch` columns of every row belong to no session: a bucketed forward covers rows
of sessions that are not in it, and those rows write their (ignored) keys and values there.
Handles carry a generation: a handle whose rows were freed or taken by another session is
stale, and its session re-prefills (as any cache miss does), never reading another's columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsbd_core.models.kv_cache import Compaction


@dataclass(frozen=True)
class SlotHandle:
    """Rows `base .. base + count - 1` of a pool, valid while the pool's generation of `base`
    is still `generation`."""

    base: int
    count: int
    generation: int


class StaticKV:
    """The pool of one model: keys and values of every layer, for `rows` x `length` columns."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        rows: int,
        length: int,
        scratch: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.scratch = scratch
        self.dtype, self.device = dtype, device
        self.data = self._allocate(rows, length)
        self._owner: list[int | None] = [None] * rows  # base of the handle owning each row
        self._generation = [0] * rows
        self._used: dict[int, int] = {}  # base -> last use (a tick), for eviction
        self._tick = 0
        self.regrowths = 0  # times the pool was reallocated (each drops captured graphs)

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    @property
    def length(self) -> int:
        """Columns a session may use (the scratch columns excluded)."""
        return self.data.shape[4] - self.scratch

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def keys(self, layer: int) -> torch.Tensor:
        """[rows, kv_heads, length + scratch, head_dim] keys of `layer` (a view of the pool)."""
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    # ------------------------------------------------------------------ rows of sessions

    def valid(self, handle: SlotHandle | None) -> bool:
        return (
            handle is not None
            and handle.base + handle.count <= self.rows
            and self._owner[handle.base] == handle.base
            and self._generation[handle.base] == handle.generation
        )

    def allocate(self, count: int, *, busy: set[int], max_rows: int) -> SlotHandle:
        """`count` free consecutive rows: first fit, else after growing the pool (up to
        `max_rows`), else after evicting the least recently used handles not in `busy`."""
        while True:
            base = self._first_fit(count)
            if base is not None:
                break
            if self.rows < max_rows:
                self.grow(rows=min(max_rows, max(self.rows * 2, self.rows + count)))
                continue
            victims = sorted((b for b in self._used if b not in busy), key=self._used.__getitem__)
            if not victims:
                raise RuntimeError(
                    f"static KV pool: {count} rows asked, {self.rows} rows (max_rows) all busy"
                )
            self.free_base(victims[0])
        for row in range(base, base + count):
            self._owner[row] = base
        self._generation[base] += 1
        self.touch(base)
        return SlotHandle(base, count, self._generation[base])

    def free(self, handle: SlotHandle | None) -> None:
        if self.valid(handle):
            assert handle is not None
            self.free_base(handle.base)

    def free_base(self, base: int) -> None:
        row = base
        while row < self.rows and self._owner[row] == base:
            self._owner[row] = None
            row += 1
        self._generation[base] += 1
        self._used.pop(base, None)

    def touch(self, base: int) -> None:
        self._tick += 1
        self._used[base] = self._tick

    def rows_in_use(self) -> int:
        return sum(owner is not None for owner in self._owner)

    def _first_fit(self, count: int) -> int | None:
        run = 0
        for row, owner in enumerate(self._owner):
            run = run + 1 if owner is None else 0
            if run == count:
                return row - count + 1
        return None

    # ------------------------------------------------------------------ storage

    def grow(self, *, rows: int | None = None, length: int | None = None) -> None:
        """Reallocate with at least `rows` rows and `length` session columns, keeping every
        row's content (new addresses: the caller captures its graphs again)."""
        rows = max(rows or 0, self.rows)
        length = max(length or 0, self.length)
        if rows == self.rows and length == self.length:
            return
        data = self._allocate(rows, length)
        data[:, :, : self.rows, :, : self.length] = self.data[:, :, :, :, : self.length]
        self.data = data
        grown = rows - len(self._owner)
        self._owner += [None] * grown
        self._generation += [0] * grown
        self.regrowths += 1

    def _allocate(self, rows: int, length: int) -> torch.Tensor:
        shape = (self.layers, 2, rows, self.kv_heads, length + self.scratch, self.head_dim)
        data = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if data.is_cuda:  # captured graphs read and write it in place, never through a copy
            torch._dynamo.mark_static_address(data)
        return data

    def compact(self, handle: SlotHandle, plan: Compaction, used: int) -> None:
        """Rows of the handle := their parent rows' kept columns (ALGORITHM.md §6.4), in place.

        `used` bounds the old columns read (the session's cached columns). One gather over all
        layers at once; the prefix is sliced, only the path columns are gathered.
        """
        n, kept = plan.columns.shape
        prefix = plan.prefix
        base = handle.base
        old = self.data[:, :, base : base + handle.count, :, :used]
        rows = old if plan.same_rows else old.index_select(2, to_device(plan.old_row, self.device))
        path = None
        if kept > prefix:
            index = to_device(plan.columns[:, prefix:], self.device)
            index = index[None, None, :, None, :, None].expand(
                self.layers, 2, n, self.kv_heads, kept - prefix, self.head_dim
            )
            path = rows[:, :, :n].gather(4, index)
        target = self.data[:, :, base : base + n]
        if not plan.same_rows:
            target[:, :, :, :, :prefix] = rows[:, :, :, :, :prefix]
        if path is not None:
            target[:, :, :, :, prefix:kept] = path


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: to CUDA through pinned memory,
    asynchronously (a copy from pageable memory blocks until the device's queue drains)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
