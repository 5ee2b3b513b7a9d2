"""A forest forward without padding: every row's new tokens packed into one query row.

A forest is laid out per cache row (tree): row r holds the new tokens of tree r, right-padded to
the longest tree, since each tree attends to its own root's KV cache (ALGORITHM.md §6.1). Trees
are uneven (all of a layer's drafts may hang under one root), so most of the padded input is
padding: 3 trees x 19 slots for 21 real tokens. On a CPU the linear layers of a bfloat16 model
cost about what their number of rows costs once past a dozen rows (on Qwen2.5-Coder-1.5B the 57
padded slots take 1.6x the time of the 21 packed tokens), so padding is paid in full.

Packed, the real tokens of every row form ONE query row, and the keys are the rows' caches laid
end to end: a query of tree r sees row r's block of that key sequence (the columns its padded
row would have seen) and, among the new tokens, exactly those of its own tree its padded row
would have seen. Positions are explicit, so nothing changes in what any token attends to or
how it is encoded; the model computes the same logits (to float round-off: the matrix products
run over other shapes). Afterwards the new keys and values are put back into the padded
per-row layout the scorer's caches use (padding slots hold zeros; nothing ever attends to them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from dsbd_core.models.forest_attention import NAME, ForestGroup, ForestSpec, PassThroughCache
from dsbd_core.models.forest_plan import additive_mask
from dsbd_core.models.row_chunks import RowGroup, RowLayout, rows_as_alone


def worth_packing(real: torch.Tensor) -> bool:
    """Pack every multi-row input of more than one slot per row: the packed forward is faster
    even where nothing is padded (a tenth on a balanced forest over Qwen2.5-Coder-1.5B's
    300-token caches), as its attention never copies the caches. A beam step (one slot per row)
    has nothing to pack."""
    rows, width = real.shape
    return rows >= 2 and width >= 2


@dataclass
class PackedPart:
    """One session's padded forward input, as `TransformerScorer` lays it out.

    input_ids, position_ids, keep, real: [R, q]; allowed: [R, q, C + q] (C cached columns per
    row); cache: R rows of C columns (None or empty when nothing is cached); dense: attend as
    the model's own attention over the padded layout (the session's forward alone is unpacked).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    keep: torch.Tensor
    real: torch.Tensor
    cache: DynamicCache | None
    dense: bool = False


def packed_forward(
    model: PreTrainedModel, parts: list[PackedPart], *, invariant: bool = True
) -> list[tuple[torch.Tensor, DynamicCache]]:
    """Each part's padded-forward outputs, from ONE packed forward of all parts' real tokens.

    Returns per part the logits at its kept slots (row-major order, as its padded forward
    returns them) and its cache grown to [R, heads, C + q, dim]. The linear layers run once
    over every part's tokens; each part attends alone with its own shapes
    (`forest_attention.ForestGroup`) and, with `invariant`, its linear rows are computed in
    calls of the size class its forward alone uses (`row_chunks.rows_as_alone`), so a part's
    outputs are the bits its own forward gives, whatever it is batched with.
    """
    device = parts[0].input_ids.device
    compute = torch.promote_types(model.dtype, torch.float32)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    groups, input_ids, position_ids, keep, kept, reals = [], [], [], [], [], []
    first = 0
    for part in parts:
        rows, q = part.input_ids.shape
        cached = part.allowed.shape[2] - q
        row, slot = part.real.nonzero(as_tuple=True)  # row-major: kept slots keep their order
        slots = torch.zeros(rows, q, dtype=torch.long, device=device)
        slots[row, slot] = torch.arange(first, first + row.numel(), device=device)
        first += row.numel()
        bias = additive_mask(part.allowed, model.dtype if part.dense else compute)
        old = (
            [(x.keys, x.values) for x in part.cache.layers]  # type: ignore[union-attr]  # attention layers: no linear attention
            if cached and part.cache is not None
            else [(None, None)] * layers
        )
        groups.append(
            ForestGroup(
                slots, part.real, bias, [k for k, _ in old], [v for _, v in old], dense=part.dense
            )
        )
        input_ids.append(part.input_ids[row, slot])
        position_ids.append(part.position_ids[row, slot])
        keep.append(part.keep[row, slot])
        kept.append(int(keep[-1].sum()))
        reals.append(row.numel())
    spec = ForestSpec(groups, dense_attention=_own_attention(model))
    cached_most = max(g.bias.shape[-1] - g.slots.shape[1] for g in groups)
    layout = _row_layout(parts, reals, kept) if invariant and len(parts) > 1 else None
    with forest_attention_for(model), rows_as_alone(layout) if layout else contextlib.nullcontext():
        output = model(
            input_ids=torch.cat(input_ids)[None],
            attention_mask=_NO_MASK.to(device),  # 4-D: transformers passes it on
            position_ids=torch.cat(position_ids)[None],
            past_key_values=PassThroughCache(cached_most),
            use_cache=True,
            logits_to_keep=torch.cat(keep)[None],
            dsbd_forest=spec,
        )
    logits = output.logits.split(kept)  # [kept, V]: a 2-D keep flattens
    return [
        (part_logits, _grown(group, layers))
        for part_logits, group in zip(logits, groups, strict=True)
    ]


def _grown(group: ForestGroup, layers: int) -> DynamicCache:
    """A part's cache after the forward: its cached columns, then its new keys and values."""
    grown = []
    for index in range(layers):
        if index in group.grown:  # the attention concatenated them already
            grown.append(group.grown[index])
            continue
        old_keys, old_values = group.old_keys[index], group.old_values[index]
        new_keys, new_values = group.new[index]
        if old_keys is None or old_values is None:
            grown.append((new_keys.contiguous(), new_values.contiguous()))
        else:
            grown.append(
                (torch.cat([old_keys, new_keys], 2), torch.cat([old_values, new_values], 2))
            )
    return DynamicCache(ddp_cache_data=grown)


def _row_layout(parts: list[PackedPart], reals: list[int], kept: list[int]) -> RowLayout:
    """Each part's rows in the packed forward (`reals` tokens, `kept` logit rows) and in its
    forward alone (a dense forward alone feeds its padding slots too; both feed only the kept
    rows to the output layer)."""
    tokens = [
        RowGroup(real, part.input_ids.numel() if part.dense else real)
        for part, real in zip(parts, reals, strict=True)
    ]
    return RowLayout(tuple(tokens), tuple(RowGroup(k, k) for k in kept))


def _own_attention(model: PreTrainedModel) -> str:
    """The attention implementation the model runs outside `forest_attention_for`."""
    return model.config.get_text_config(decoder=True)._attn_implementation


_NO_MASK = torch.zeros(1, 1, 1, 1)


@contextlib.contextmanager
def forest_attention_for(model: PreTrainedModel) -> Iterator[None]:
    """Within the block the model's attention is `forest_attention` (restored afterwards)."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}
    before = {key: c._attn_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = NAME
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = before[key]
