"""Attention for packed forests: packed linear layers, per-tree attention, no cache copies.

`packed_forward` feeds every real token of a forest as ONE query row, so the linear layers see
no padding. Attention must still follow the padded layout: a token of tree r attends to row r's
cached columns and to its own ancestors among the new tokens. Laying the rows' caches end to end
(one key row for all trees) did that with masks, but copied every cache twice per forward and
made each query score every tree's columns: on Qwen2.5-Coder-1.5B, for a 21-token forest over
three 300-token caches, 34 ms of copies and 31 ms of attention against 5 ms for a beam step.

This attention function (registered with transformers as `dsbd_forest`) takes the queries and
the new keys and values of the packed row, groups them back by tree (`ForestSpec.slots`: the
padded layout, padding slots masked), and attends each tree to its own cached keys where they
lie, in place: scores against the old columns and against the new ones are computed apart and
share one softmax. The new keys and values are kept per tree for the cache the scorer keeps.
Grouped-query attention is done by viewing the query heads of one key/value head together, never
by repeating the keys.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "dsbd_forest"


@dataclass
class ForestGroup:
    """One session's trees in the packed row: what its own forward would attend to.

    slots: [R, q] long — packed position of tree r's slot s (0 where the slot is padding).
    real:  [R, q] bool — the slots that hold a token (the others are padding).
    bias:  [R, 1, q, C + q] additive mask of the padded layout (0 allowed, min not): float32
           (float64 for float64 models) for a forest group, the model dtype for a dense one.
    old_keys / old_values: per layer [R, kv_heads, C, dim] — the trees' cached columns.
    dense: attend as the model's own `sdpa`/`eager` attention does over the padded layout: the
           session's forward alone would not have been packed (`packed_forward.worth_packing`).
    new: per layer (keys, values) [R, kv_heads, q, dim] — filled by the forward.
    grown: per layer (keys, values) [R, kv_heads, C + q, dim] where the attention already
           concatenated the cached columns and the new ones (a dense group with a cache): the
           grown cache, not made twice.
    """

    slots: torch.Tensor
    real: torch.Tensor
    bias: torch.Tensor
    old_keys: list[torch.Tensor | None]
    old_values: list[torch.Tensor | None]
    dense: bool = False
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    grown: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class ForestSpec:
    """What the attention needs besides the packed row, for one forward: one group per session.

    Each group attends with exactly the shapes its session's forward alone has (its own cached
    columns, its own padded width), never a layout widened to its batch mates': a session's
    outputs are then bit-identical whatever it is batched with (a masked gap or a longer row
    moves the last bits of a bfloat16 softmax and its reductions).
    """

    groups: list[ForestGroup]
    dense_attention: str = "sdpa"


class PassThroughCache(DynamicCache):
    """A cache that keeps nothing: `update` hands the new keys and values straight to the
    attention (the trees' own caches are in the `ForestSpec`)."""

    def __init__(self, cached_columns: int) -> None:
        super().__init__()
        self._cached = cached_columns

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN201
        return key_states, value_states

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._cached


def forest_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, M, dim], key/value [1, kv_heads, M, dim] of the packed row -> the
    attention output [1, M, heads, dim], each tree attending to its own cache and ancestors."""
    spec = kwargs["dsbd_forest"]
    assert isinstance(spec, ForestSpec)
    heads, _, dim = query.shape[1:]
    packed = query.new_zeros(heads, query.shape[2], dim)
    scale = scaling if scaling is not None else dim**-0.5
    for group in spec.groups:
        new_keys, new_values = _new_keys_values(module, key, value, group)
        if group.dense:
            out = _attend_dense(
                module, query, new_keys, new_values, group, scale, spec.dense_attention
            )
        else:
            layer: int = module.layer_idx  # type: ignore[assignment]  # HF attention's int layer_idx
            out = _attend_forest(query, new_keys, new_values, layer, group, scale)
        real = group.real.reshape(-1)
        packed[:, group.slots.reshape(-1)[real]] = out[:, real]
    return packed.transpose(0, 1)[None], None


def _new_keys_values(
    module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, group: ForestGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's new keys and values in its padded layout, [R, kv_heads, q, dim] each; kept
    in `group.new` for the cache the scorer keeps."""
    kv_heads, dim = key.shape[1], key.shape[3]
    trees, width = group.slots.shape
    index = group.slots.reshape(-1)
    new_keys = key[0][:, index].view(kv_heads, trees, width, dim).transpose(0, 1)
    new_values = value[0][:, index].view(kv_heads, trees, width, dim).transpose(0, 1)
    group.new[module.layer_idx] = (new_keys, new_values)  # type: ignore[index]  # HF attention's int layer_idx
    return new_keys, new_values


def _attend_forest(
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    layer: int,
    group: ForestGroup,
    scale: float,
) -> torch.Tensor:
    """One group's trees attended in place: [heads, R * q, dim] in the padded layout's order."""
    heads, _, dim = query.shape[1:]
    kv_heads = new_keys.shape[1]
    rep = heads // kv_heads
    trees, width = group.slots.shape
    index = group.slots.reshape(-1)
    # [kv_heads, rep, R * q, dim] -> [R, kv_heads, rep * q, dim]: a key head's query heads together
    q = query[0].view(kv_heads, rep, -1, dim)[:, :, index]
    q = q.view(kv_heads, rep, trees, width, dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(trees, kv_heads, rep * width, dim)
    parts = [torch.matmul(q, new_keys.transpose(-1, -2))]
    old_keys, old_values = group.old_keys[layer], group.old_values[layer]
    if old_keys is not None:
        parts.insert(0, torch.matmul(q, old_keys.transpose(-1, -2)))
    # softmax in float32 (float64 for float64 models: the exactness tests' reference)
    compute = torch.promote_types(query.dtype, torch.float32)
    scores = torch.cat(parts, dim=-1).to(compute).mul_(scale)  # [R, kv_heads, rep * q, C + q]
    scores = scores.view(trees, kv_heads, rep, width, -1).add_(group.bias[:, :, None])
    probs = torch.softmax(scores, dim=-1).to(query.dtype).view(trees, kv_heads, rep * width, -1)
    cached = old_keys.shape[2] if old_keys is not None else 0
    out = torch.matmul(probs[..., cached:], new_values)
    if old_values is not None:
        out = out + torch.matmul(probs[..., :cached], old_values)
    # back to the packed order: [R, kv_heads, rep, q, dim] -> [heads, R * q, dim]
    return out.view(trees, kv_heads, rep, width, dim).permute(1, 2, 0, 3, 4).reshape(heads, -1, dim)


def _attend_dense(
    module: torch.nn.Module,
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    group: ForestGroup,
    scale: float,
    implementation: str,
) -> torch.Tensor:
    """One group attended by the model's own attention function over its padded layout, as
    its forward alone runs it (a beam step, one tree): [heads, R * q, dim] in padded order."""
    layer: int = module.layer_idx  # type: ignore[assignment]  # HF attention's int layer_idx
    heads, _, dim = query.shape[1:]
    trees, width = group.slots.shape
    index = group.slots.reshape(-1)
    q = query[0][:, index].view(heads, trees, width, dim).transpose(0, 1)
    old_keys, old_values = group.old_keys[layer], group.old_values[layer]
    keys, values = new_keys, new_values
    if old_keys is not None and old_values is not None:
        keys, values = torch.cat([old_keys, new_keys], 2), torch.cat([old_values, new_values], 2)
        group.grown[layer] = (keys, values)
    attend = own_attention(module, implementation)
    out, _ = attend(module, q, keys, values, group.bias, dropout=0.0, scaling=scale)
    return out.permute(2, 0, 1, 3).reshape(heads, -1, dim)  # [R, q, heads, dim] -> padded order


def own_attention(module: torch.nn.Module, implementation: str) -> Callable[..., tuple]:
    """The attention function `module`'s layer calls for `implementation` (`eager`: its
    modeling file's own; otherwise transformers' registered one, e.g. `sdpa`)."""
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


AttentionInterface.register(NAME, forest_attention)
