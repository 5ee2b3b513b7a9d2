"""A session forward over a forest: its model input, where its outputs go (ALGORITHM.md §6.1).

Per cache row (tree): the root's uncached tokens, then the tree's nodes layer by layer, right-
padded; explicit position ids and a 4-D boolean mask that lets each node see its root's prefix,
its ancestors and itself only. After the forward, the kept log-probs are scattered back to the
roots' and layers' outputs and the new cache columns are recorded in the session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from dsbd_core.algorithm.scorer import ForestLayer
from dsbd_core.models.kv_cache import PAD_COLUMN, LayerPlacement, SessionCache, SlotPlacement


@dataclass
class ForestPlan:
    """The padded model input of one session forward and where to read its outputs."""

    input_ids: torch.Tensor  # [n, q]
    position_ids: torch.Tensor  # [n, q]
    allowed: torch.Tensor  # [n, q, C + q] bool
    keep: torch.Tensor  # [n, q] bool: positions whose logits are needed
    uncached: int  # root tokens fed in this forward (0 if the roots were already fed)
    placements: list[LayerPlacement]
    node_index: list[torch.Tensor]  # per layer: indices of the existing nodes


def scatter_outputs(
    b: int,
    session: SessionCache,
    plan: ForestPlan,
    logprobs: torch.Tensor,
    rank: torch.Tensor,
    roots: torch.Tensor | None,
    outs: list[torch.Tensor],
) -> None:
    """Write one session's root and node log-probs; `rank` maps its (row, query) to kept rows."""
    if plan.uncached > 0 and roots is not None:
        roots[b, session.rows] = logprobs[rank[:, plan.uncached - 1]]
    for out, placement, index in zip(outs, plan.placements, plan.node_index, strict=True):
        if index.numel() > 0:
            row = placement.row[index]
            query = placement.column[index] - session.cached_cols
            out[b, index] = logprobs[rank[row, query]]


def plan_forward(
    b: int, session: SessionCache, layers: Sequence[ForestLayer], root_count: int
) -> ForestPlan:
    """Lay out one session's forward: root tail then each tree's nodes, per row
    (ALGORITHM.md §6.1)."""
    device = session.tokens.device
    n = session.rows.numel()
    c_old = session.cached_cols
    uncached = session.length - session.prefix_cols
    if uncached > 0 and c_old != session.prefix_cols:
        raise AssertionError("nodes cached before the roots were fed")
    local_of_root = torch.full((root_count,), -1, dtype=torch.long, device=device)
    local_of_root[session.rows] = torch.arange(n, device=device)
    fill = torch.zeros(n, dtype=torch.long, device=device)  # nodes placed per row so far
    previous = session.layers[-1] if session.layers else None
    placements: list[LayerPlacement] = []
    node_index: list[torch.Tensor] = []
    for offset, layer in enumerate(layers):
        depth = len(session.layers) + offset + 1
        placement, index = _place_layer(
            b, layer, depth, previous, local_of_root, fill, uncached + c_old
        )
        placements.append(placement)
        node_index.append(index)
        previous = placement
    q_len = uncached + int(fill.max()) if n > 0 else 0
    input_ids = torch.zeros(n, q_len, dtype=torch.long, device=device)
    position_ids = torch.zeros(n, q_len, dtype=torch.long, device=device)
    keep = torch.zeros(n, q_len, dtype=torch.bool, device=device)
    allowed = _padding_allowed(n, q_len, c_old, device)
    if uncached > 0:
        input_ids[:, :uncached] = session.tokens[:, session.prefix_cols :]
        position_ids[:, :uncached] = torch.arange(
            session.prefix_cols, session.length, device=device
        )
        columns = torch.arange(c_old + q_len, device=device)
        queries = torch.arange(uncached, device=device)
        allowed[:, :uncached] = columns[None, :] <= (c_old + queries)[:, None]  # causal
        keep[:, uncached - 1] = True
    for depth_offset, (layer, placement, index) in enumerate(
        zip(layers, placements, node_index, strict=True)
    ):
        depth = len(session.layers) + depth_offset + 1
        row = placement.row[index]
        query = placement.column[index] - c_old
        input_ids[row, query] = layer.token[b, index]
        position_ids[row, query] = session.length - 1 + depth
        allowed[row, query, : session.length] = True  # the whole root prefix
        allowed[row[:, None], query[:, None], placement.ancestors[index]] = True
        keep[row, query] = True
    return ForestPlan(input_ids, position_ids, allowed, keep, uncached, placements, node_index)


def _place_layer(
    b: int,
    layer: ForestLayer,
    depth: int,
    previous: LayerPlacement | SlotPlacement | None,
    local_of_root: torch.Tensor,
    fill: torch.Tensor,
    first_node_column: int,
) -> tuple[LayerPlacement, torch.Tensor]:
    """Give every existing node of a layer its tree row and cache column; updates `fill`.

    Nodes of one tree are placed in node order after the nodes already placed in that row in
    this forward, so ancestors always precede descendants (their columns are smaller).
    """
    device = fill.device
    m = layer.token.shape[1]
    index = layer.exists[b].nonzero().squeeze(1)
    parent = layer.parent[b, index]
    if depth == 1:
        row = local_of_root[parent]
        parent_ancestors = torch.empty(index.numel(), 0, dtype=torch.long, device=device)
    else:
        if previous is None:
            raise ValueError(f"layer {depth} given before layer {depth - 1} was fed")
        row = previous.row[parent]
        parent_ancestors = previous.ancestors[parent]
    if bool((row < 0).any()):
        raise ValueError(f"session {b}, layer {depth}: a node's parent is dead or padding")
    one_hot = torch.nn.functional.one_hot(row, fill.numel())  # [k, n]
    rank = (one_hot.cumsum(0) - one_hot).gather(1, row[:, None]).squeeze(1)
    column = first_node_column + fill[row] + rank
    fill += one_hot.sum(0)
    placement = LayerPlacement(
        row=torch.full((m,), -1, dtype=torch.long, device=device),
        column=torch.full((m,), -1, dtype=torch.long, device=device),
        ancestors=torch.full((m, depth), -1, dtype=torch.long, device=device),
    )
    placement.row[index] = row
    placement.column[index] = column
    placement.ancestors[index] = torch.cat([parent_ancestors, column[:, None]], dim=1)
    return placement, index


def _padding_allowed(n: int, q_len: int, c_old: int, device: torch.device) -> torch.Tensor:
    """Start every query row as padding: it sees only its own column (finite softmax)."""
    allowed = torch.zeros(n, q_len, c_old + q_len, dtype=torch.bool, device=device)
    queries = torch.arange(q_len, device=device)
    allowed[:, queries, c_old + queries] = True
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, q, kv] bool -> [n, 1, q, kv] additive mask (0 allowed, dtype-min disallowed)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def record_plan(session: SessionCache, cache: DynamicCache, plan: ForestPlan) -> None:
    """Remember what the forward appended to the cache (token ids, placements, root prefix)."""
    fed = plan.input_ids.clone()
    real = plan.keep.clone()
    real[:, : plan.uncached] = True  # root tokens are real even where no logits were kept
    fed[~real] = PAD_COLUMN
    session.cache = cache
    session.column_tokens = torch.cat([session.column_tokens, fed], dim=1)
    session.prefix_cols = session.length
    session.layers.extend(plan.placements)
