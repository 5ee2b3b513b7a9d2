"""The KV cache of one scoring session, and its compaction to the next iteration's roots.

Caches are compacted at `set_roots` (ALGORITHM.md §6.4): new row `o` = old row `origin.root[o]`
restricted to the prefix columns plus the columns of the path nodes this scorer fed, gathered
along the sequence axis. The token id of every cache column is kept, so a compaction whose
kept tokens do not equal the new beam's leading tokens falls back to a re-prefill instead of
returning wrong distributions. A batched forward attends each session over its own cache
(`packed_forward`): caches are never stacked into a shared layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

PAD_COLUMN = -1  # token id recorded for a padding column of the cache (never a real token)
NODE_COLUMN = -2  # a node slot of the slot layout: its token is the accepted beam's, if kept


@dataclass
class LayerPlacement:
    """Where the nodes of one fed forest layer of one session sit in the cache.

    row:       [M] long — local cache row (tree) of each node, -1 for a padding node.
    column:    [M] long — cache column of each node, -1 for a padding node.
    ancestors: [M, l] long — cache columns of the node's ancestors at layers 1..l, itself last;
               a node's mask row over the node part is exactly these columns.
    """

    row: torch.Tensor
    column: torch.Tensor
    ancestors: torch.Tensor


@dataclass
class SlotPlacement:
    """Where the nodes of one layer fed in the slot layout (`slot_layout`) sit in the cache.

    row:       [M] long, on the model's device — local tree row of each node, -1 for padding.
    ancestors: [M, l] long, on the model's device — the node's ancestors' columns, itself last.
    first_column / width: node s sits at column first_column + s of every row (host numbers).
    """

    row: torch.Tensor
    ancestors: torch.Tensor
    first_column: int
    width: int


@dataclass
class SessionCache:
    """The KV cache of one session and what each of its columns holds.

    rows:          [n] long — root index (in `R`) of each cache row, i.e. the alive roots.
    tokens:        [n, length] long — the roots' full token sequences.
    cache:         the model's cache, batch rows = `rows`; None when nothing is cached yet.
    column_tokens: [n, C] long — token id of every cache column (PAD_COLUMN for padding slots).
    prefix_cols:   number of leading columns that are root tokens (the root prefix cached).
    layers:        placements of the forest layers fed since `set_roots`.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    # a DynamicCache (TransformerScorer) or a static_cache.SlotHandle (StaticScorer): Any, as
    # the code each scorer shares sees either
    cache: Any
    column_tokens: torch.Tensor
    prefix_cols: int
    layers: list[LayerPlacement | SlotPlacement] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def cached_cols(self) -> int:
        return self.column_tokens.shape[1]

    @property
    def roots_fed(self) -> bool:
        return self.prefix_cols == self.length


@dataclass
class Compaction:
    """What each new root keeps of the old cache (ALGORITHM.md §6.4), whatever holds the cache.

    old_row: [n] long — the old cache row (local) every new root descends from.
    columns: [n, K] long — the old row's columns it keeps, in order (prefix, then its path).
    column_tokens: [n, K] long — their token ids (equal to the new roots' first K tokens).
    prefix: the leading columns that are 0..prefix-1 in every row (sliced, not gathered).
    same_rows: new row i is old row i for every i (no row gather needed).
    """

    old_row: torch.Tensor
    columns: torch.Tensor
    column_tokens: torch.Tensor
    prefix: int
    same_rows: bool


def plan_compaction(
    old: SessionCache, tokens: torch.Tensor, old_root: torch.Tensor, path: torch.Tensor
) -> Compaction | None:
    """Which old cache columns each new root keeps, or None when a re-prefill is needed.

    tokens: [n, length] the new roots; old_root: [n] old root index; path: [n, D] node per layer.
    None for an unknown old root, nothing kept, or kept token ids differing from the new beams'.
    """
    device = tokens.device
    local_of_root = torch.full(
        (max(int(old.rows.max()), int(old_root.max())) + 1,), -1, dtype=torch.long, device=device
    )
    local_of_root[old.rows] = torch.arange(old.rows.numel(), device=device)
    if bool((old_root < 0).any()):
        return None
    old_row = local_of_root[old_root]
    if bool((old_row < 0).any()) or old.cache is None:
        return None
    path_columns = _path_columns(old, old_row, path)
    columns = torch.cat(
        [torch.arange(old.prefix_cols, device=device).expand(old_row.numel(), -1), path_columns],
        dim=1,
    )[:, : tokens.shape[1] - 1]  # the last token of a beam is always fed again
    kept = columns.shape[1]
    if kept == 0:
        return None
    column_tokens = old.column_tokens[old_row].gather(1, columns)
    node = column_tokens == NODE_COLUMN  # slot layout: the kept path's tokens are the beam's
    if not torch.equal(torch.where(node, tokens[:, :kept], column_tokens), tokens[:, :kept]):
        return None
    column_tokens = tokens[:, :kept]
    prefix = min(old.prefix_cols, kept)  # columns[:, :prefix] is 0..prefix-1 in every row
    same_rows = old_row.numel() == old.rows.numel() and bool(
        (old_row == torch.arange(old_row.numel(), device=device)).all()
    )
    return Compaction(old_row, columns, column_tokens, prefix, same_rows)


def compact_cache(
    old: SessionCache, tokens: torch.Tensor, old_root: torch.Tensor, path: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor] | None:
    """Gather the old cache down to the new roots' accepted paths (ALGORITHM.md §6.4): the new cache
    and its column tokens, or None when a re-prefill is needed (`plan_compaction`)."""
    plan = plan_compaction(old, tokens, old_root, path)
    if plan is None:
        return None
    assert old.cache is not None
    data = []
    for layer in old.cache.layers:
        data.append(
            (
                gather_columns(layer.keys, plan.old_row, plan.columns, plan.prefix, plan.same_rows),
                gather_columns(
                    layer.values, plan.old_row, plan.columns, plan.prefix, plan.same_rows
                ),
            )
        )
    return DynamicCache(ddp_cache_data=data), plan.column_tokens


def _path_columns(old: SessionCache, old_row: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """[n, K] cache columns of the path nodes every new root keeps (same K for all rows).

    A row keeps its path while each node was fed, lies in the row's tree and descends from the
    previously kept node (its ancestor columns equal the kept ones); all rows are cut to the
    shortest kept path because a session's cache rows share one length. A layer fed in the
    slot layout is taken as given (`slot_layout`: its rows are on the device).
    """
    n = old_row.numel()
    columns = torch.empty(n, 0, dtype=torch.long, device=old_row.device)
    going = torch.ones(n, dtype=torch.bool, device=old_row.device)
    for depth in range(min(path.shape[1], len(old.layers))):
        placement = old.layers[depth]
        node = path[:, depth]
        if isinstance(placement, SlotPlacement):  # its rows live on the device: not read
            going &= (node >= 0) & (node < placement.width)
            if not bool(going.all()):
                break
            columns = torch.cat([columns, placement.first_column + node[:, None]], dim=1)
            continue
        safe = node.clamp(0, placement.row.numel() - 1)
        column = placement.column[safe]
        ancestors = placement.ancestors[safe]
        going &= (node >= 0) & (node < placement.row.numel())
        going &= (placement.row[safe] == old_row) & (column >= 0)
        going &= (ancestors[:, :depth] == columns).all(dim=1)
        if not bool(going.all()):
            break
        columns = torch.cat([columns, column[:, None]], dim=1)
    return columns


def gather_columns(
    states: torch.Tensor,
    old_row: torch.Tensor,
    columns: torch.Tensor,
    prefix: int,
    same_rows: bool,
) -> torch.Tensor:
    """[rows, heads, C, dim] -> [n, heads, K, dim]: row old_row[i], columns columns[i].

    The first `prefix` columns are the same contiguous range in every row (the cached prefix),
    so they are sliced; only the path columns after them (a few per row) are gathered. A
    gather over the whole cache would need an index as large as the cache itself (int64: four
    times a bfloat16 cache) and cost more than the forward's own cache copy.
    """
    selected = states if same_rows else states.index_select(0, old_row)
    if columns.shape[1] == prefix:
        return selected[:, :, :prefix]
    heads, dim = selected.shape[1], selected.shape[3]
    index = columns[:, None, prefix:, None].expand(-1, heads, -1, dim)
    return torch.cat([selected[:, :, :prefix], selected.gather(2, index)], dim=2)
