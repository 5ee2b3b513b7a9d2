"""The forest's layout planned on the model's device: every tree row gets every node slot.

The host layout (`forest_plan`) puts each node in its own tree's row, packed: the fewest query
slots, but planning it reads which nodes exist (`nonzero`, the rows' fill): beside a GPU every
forward of the draft loop and the verify would wait for the device to say. This layout is
fixed by the layers' widths alone: layer j's M_j slots sit at the same query positions and cache
columns in every row of the session; a slot is real in the row of its tree and padding (it
sees only itself) in the others. Rows, masks, ancestry and where the outputs come from are
device ops (gathers, compares, scatters) on the layer tensors where the engine left them, so a
forward queues behind the draft's draw without waiting for it, and an iteration waits once
(the engine's planning read).

The price is n times the query slots (n = the session's rows): on a GPU a matmul of up to ~64
rows costs what one row costs, so a verify of W = 3, gamma = 3, W_S = 3 (27 slots) costs
what its 9 nodes would. On a CPU the slots cost arithmetic, and the host layout (whose reads
are free there) stays.

The columns of a layer's slots are known on the host (they depend on the widths only); which
row a node is real in is not. Compaction therefore takes a path node's column from its slot
and trusts that the engine's accepted path descends from the root it names (it does by
construction: `origin.path` lists the drafted nodes of that root's tree); the host layout checks
it against its recorded placements instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsbd_core.algorithm.scorer import ForestLayer
from dsbd_core.models.kv_cache import NODE_COLUMN, SessionCache, SlotPlacement
from dsbd_core.models.static_cache import to_device


@dataclass
class SlotPlan:
    """One session's forward in the slot layout: device tensors and host counts.

    input_ids / position_ids: [n, q]; allowed: [n, q, cached + q] bool; uncached: root tokens
    fed first; offsets: each layer's first query slot; placements: what the cache will hold.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    uncached: int
    offsets: list[int]
    placements: list[SlotPlacement]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def plan_slots(
    b: int,
    session: SessionCache,
    layers: Sequence[ForestLayer],
    root_count: int,
    device: torch.device,
) -> SlotPlan:
    """Lay out session b's forward: its uncached root tokens, then every layer's slots in
    every row (module docstring). No value of a device tensor is read."""
    n = session.rows.numel()
    c_old = session.cached_cols
    uncached = session.length - session.prefix_cols
    if uncached > 0 and c_old != session.prefix_cols:
        raise AssertionError("nodes cached before the roots were fed")
    widths = [layer.token.shape[1] for layer in layers]
    offsets = [uncached + sum(widths[:j]) for j in range(len(layers))]
    q = uncached + sum(widths)
    columns = c_old + q
    row_ids = torch.arange(n, device=device)
    input_ids = torch.zeros(n, q, dtype=torch.long, device=device)
    position_ids = torch.zeros(n, q, dtype=torch.long, device=device)
    span = torch.arange(q, device=device)
    allowed = torch.zeros(n, q, columns, dtype=torch.bool, device=device)
    allowed[:, span, c_old + span] = True  # every slot sees itself (a padding slot only that)
    if uncached > 0:
        tail = to_device(session.tokens[:, session.prefix_cols :], device)
        input_ids[:, :uncached] = tail
        position_ids[:, :uncached] = torch.arange(
            session.prefix_cols, session.length, device=device
        )
        causal = torch.arange(columns, device=device)[None, :] <= (c_old + span[:uncached])[:, None]
        allowed[:, :uncached] = causal
    local_of_root = torch.full((root_count,), -1, dtype=torch.long)
    local_of_root[session.rows] = torch.arange(n)
    local_of_root = to_device(local_of_root, device)
    previous = session.layers[-1] if session.layers else None
    prefix = torch.arange(columns, device=device) < session.length  # the whole root prefix
    placements = []
    for j, layer in enumerate(layers):
        depth = len(session.layers) + j + 1
        width, first = widths[j], offsets[j]
        parent, exists = layer.parent[b], layer.exists[b]
        column = c_old + first + torch.arange(width, device=device)
        if depth == 1:
            row = local_of_root[parent.clamp(0, root_count - 1)]
            ancestors = column[:, None]
        else:
            if previous is None:
                raise ValueError(f"layer {depth} given before layer {depth - 1} was fed")
            safe = parent.clamp(0, previous.row.numel() - 1)
            row = previous.row[safe]
            ancestors = torch.cat([previous.ancestors[safe], column[:, None]], dim=1)
        row = torch.where(exists, row, -1)
        real = row[None, :] == row_ids[:, None]  # [n, M]: the node is real in this row
        seen = torch.zeros(width, columns, dtype=torch.bool, device=device)
        seen.scatter_(1, ancestors.clamp(min=0), True)  # a host layout's padding: -1
        slots = slice(first, first + width)
        allowed[:, slots] |= real[:, :, None] & (prefix[None, None, :] | seen[None])
        input_ids[:, slots] = layer.token[b][None, :]
        position_ids[:, slots] = session.length - 1 + depth
        placement = SlotPlacement(
            row=row, ancestors=ancestors, first_column=c_old + first, width=width
        )
        placements.append(placement)
        previous = placement
    return SlotPlan(input_ids, position_ids, allowed, uncached, offsets, placements)


def gather_outputs(
    b: int,
    session: SessionCache,
    plan: SlotPlan,
    logprobs: torch.Tensor,
    first_row: int,
    roots: torch.Tensor | None,
    outs: list[torch.Tensor],
) -> None:
    """Write session b's root and node log-probs from the step's [rows, slots, V] output, whose
    row `first_row` is the session's first: gathers on the device, no read."""
    n = session.rows.numel()
    device = logprobs.device
    if plan.uncached > 0 and roots is not None:
        rows = to_device(session.rows, device)
        roots[b, rows] = logprobs[first_row : first_row + n, plan.uncached - 1].to(roots.dtype)
    for out, placement, start in zip(outs, plan.placements, plan.offsets, strict=True):
        width = placement.width
        row = first_row + placement.row.clamp(min=0)
        slot = start + torch.arange(width, device=device)
        values = logprobs[row, slot].to(out.dtype)
        out[b] = torch.where((placement.row >= 0)[:, None], values, out.new_zeros(()))


def record_slots(session: SessionCache, cache: object, plan: SlotPlan) -> None:
    """Remember what the forward appended: the root tokens fed, then node columns whose tokens
    the compaction takes from the accepted beams (`kv_cache.NODE_COLUMN`)."""
    n = session.rows.numel()
    fed = torch.full((n, plan.width), NODE_COLUMN, dtype=torch.long)
    fed[:, : plan.uncached] = session.tokens[:, session.prefix_cols :]
    session.cache = cache
    session.column_tokens = torch.cat([session.column_tokens, fed], dim=1)
    session.prefix_cols = session.length
    session.layers.extend(plan.placements)
