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

import torch
from transformers import DynamicCache, PreTrainedModel

from dsbd_core.models.forest_plan import _additive_mask


def worth_packing(real: torch.Tensor) -> bool:
    """Pack when at least a quarter of a multi-row input (and 4 slots or more) is padding: the
    packed path copies the cache twice more, which a few saved slots do not repay."""
    rows, width = real.shape
    if rows < 2 or width < 2:
        return False
    padding = rows * width - int(real.sum())
    return padding >= max(4, rows * width // 4)


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
    m = row.numel()
    mask = torch.zeros(m, rows * cached + m, dtype=torch.bool, device=allowed.device)
    if cached:
        blocks = mask[:, : rows * cached].view(m, rows, cached)
        blocks[torch.arange(m, device=row.device), row] = allowed[row, slot, :cached]
    same_tree = row[:, None] == row[None, :]
    mask[:, rows * cached :] = (
        allowed[row[:, None], slot[:, None], cached + slot[None, :]] & same_tree
    )
    packed = DynamicCache()
    if cached:
        packed = DynamicCache(ddp_cache_data=[(_end_to_end(layer.keys), _end_to_end(layer.values))
                                              for layer in cache.layers])  # fmt: skip
    output = model(
        input_ids=input_ids[row, slot][None],
        attention_mask=_additive_mask(mask[None], model.dtype),
        position_ids=position_ids[row, slot][None],
        past_key_values=packed,
        use_cache=True,
        logits_to_keep=keep[row, slot][None],
    )
    grown = []
    for index, layer in enumerate(output.past_key_values.layers):
        new_keys, new_values = (
            layer.keys[0, :, rows * cached :],
            layer.values[0, :, rows * cached :],
        )
        old = cache.layers[index] if cached else None
        grown.append((_back_to_rows(new_keys, old.keys if old else None, row, slot, rows, q),
                      _back_to_rows(new_values, old.values if old else None, row, slot, rows,
                                    q)))  # fmt: skip
    return output.logits, DynamicCache(ddp_cache_data=grown)  # [kept, V]: a 2-D keep flattens


def _end_to_end(states: torch.Tensor) -> torch.Tensor:
    """[R, heads, C, dim] -> [1, heads, R * C, dim]: the rows' columns one after another."""
    rows, heads, cached, dim = states.shape
    return states.transpose(0, 1).reshape(1, heads, rows * cached, dim)


def _back_to_rows(
    new: torch.Tensor,
    old: torch.Tensor | None,
    row: torch.Tensor,
    slot: torch.Tensor,
    rows: int,
    q: int,
) -> torch.Tensor:
    """The packed new columns [heads, m, dim] in the padded layout after the old cache:
    [R, heads, C + q, dim], zeros in the padding slots."""
    heads, _, dim = new.shape
    padded = new.new_zeros(rows, q, heads, dim)
    padded[row, slot] = new.transpose(0, 1)
    padded = padded.transpose(1, 2)
    return padded.contiguous() if old is None else torch.cat([old, padded], dim=2)
