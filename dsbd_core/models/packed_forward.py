"""A forest forward without padding: every row's new tokens packed into one query row.

A forest is laid out per cache row (tree): row r holds the new tokens of tree r, right-padded to
the longest tree, because each tree must attend to its own root's KV cache (spec §6.1). Trees
are uneven (all of a layer's drafts may hang under one root), so most of the padded input is
padding: 3 trees x 19 slots for 21 real tokens. On a CPU the linear layers of a bfloat16 model
cost about what their number of rows costs once past a dozen rows (Qwen2.5-Coder-1.5B, 1
thread: 3 x 19 slots 641 ms, 1 x 21 tokens 393 ms), so padding is paid in full.

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

import torch
from transformers import DynamicCache, PreTrainedModel

from dsbd_core.models.forest_attention import NAME, ForestSpec, PassThroughCache


def worth_packing(real: torch.Tensor) -> bool:
    """Pack every multi-row input of more than one slot per row: measured on Qwen2.5-Coder-1.5B
    (3 trees over 300-token caches), the packed forward is faster even without padding (a
    balanced 15-token forest: 380 ms packed, 423 ms padded), as its attention never copies the
    caches. A beam step (one slot per row) has nothing to pack."""
    rows, width = real.shape
    return rows >= 2 and width >= 2


def packed_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    allowed: torch.Tensor,
    keep: torch.Tensor,
    real: torch.Tensor,
    cache: DynamicCache,
) -> tuple[torch.Tensor, DynamicCache]:
    """The padded forward's outputs from one packed forward.

    input_ids, position_ids, keep, real: [R, q]; allowed: [R, q, C + q] (C cached columns per
    row); cache: R rows of C columns. Returns the logits at the kept slots (row-major order, as
    the padded forward returns them) and the cache grown to [R, heads, C + q, dim].
    """
    rows, q = input_ids.shape
    cached = allowed.shape[2] - q
    row, slot = real.nonzero(as_tuple=True)  # row-major: kept slots keep their order
    slots = torch.zeros(rows, q, dtype=torch.long, device=input_ids.device)
    slots[row, slot] = torch.arange(row.numel(), device=input_ids.device)
    compute = torch.promote_types(model.dtype, torch.float32)
    bias = torch.zeros(allowed.shape, dtype=compute, device=allowed.device)
    bias.masked_fill_(~allowed, torch.finfo(compute).min)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    old = [(x.keys, x.values) for x in cache.layers] if cached else [(None, None)] * layers
    spec = ForestSpec(slots, real, bias[:, None], [k for k, _ in old], [v for _, v in old])
    with forest_attention_for(model):
        output = model(
            input_ids=input_ids[row, slot][None],
            attention_mask=_NO_MASK.to(input_ids.device),  # 4-D: transformers passes it on
            position_ids=position_ids[row, slot][None],
            past_key_values=PassThroughCache(cached),
            use_cache=True,
            logits_to_keep=keep[row, slot][None],
            dsbd_forest=spec,
        )
    grown = []
    for index, (old_keys, old_values) in enumerate(old):
        new_keys, new_values = spec.new[index]
        if old_keys is None:
            grown.append((new_keys.contiguous(), new_values.contiguous()))
        else:
            grown.append(
                (torch.cat([old_keys, new_keys], 2), torch.cat([old_values, new_values], 2))
            )
    return output.logits, DynamicCache(ddp_cache_data=grown)  # [kept, V]: a 2-D keep flattens


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
