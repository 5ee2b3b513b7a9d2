"""Linear layers that compute each session's rows as its forward alone would: batch invariance.

A seeded request must draw the same tokens whether its forward runs alone or batched with other
requests' (a served decode equals the in-process one). The scorer attends each session alone
(`packed_forward`), so what is left is the linear layers, which see every session's rows at
once. On these CPUs (oneDNN, AMX-BF16) a bfloat16 matmul computes a row with one kernel when the
call has 1 to 32 rows and with another, whose last bits differ, from 33 rows on (every q/k/v,
MLP and output layer of SmolLM2 on real activations;
`benchmarks/investigations/batch_invariance/attention_gap.py` at commit 637ed2c). A session whose
forward alone has at most `ROW_CHUNK` rows must therefore get its rows computed in a call of at most
`ROW_CHUNK` rows when batched too, and a larger one in a call of more.

Inside `rows_as_alone(layout)` (set by `packed_forward` for a batched forward) a
`RowChunkedLinear` does exactly that: the small sessions' rows share calls of 32 rows, a large
session gets a call of its own (padded to 33 rows where its real rows are fewer, as a
padded dense forward counts its padding). Outside it (a forward alone) every call is one call.
Either way a CPU bfloat16 call without autograd uses the weight reordered once into oneDNN's
blocked layout (`torch.ops.mkldnn._linear_pointwise`: a decode alone about 16 % faster; the
reordered copy takes as much memory as the weight,
`benchmarks/investigations/batch_invariance/prepacked_memory.py` at commit 637ed2c).
float32/float64 inputs and non-CPU devices (other kernels, not measured here) run `F.linear`
as `nn.Linear` does.

Cost: a call of 32 rows costs most of what one of 128 costs (576 x 1536: 137 us vs 273 us), so a
batched forward of many small sessions does more, smaller calls (eight concurrent seeded
decodes: `benchmarks/investigations/batch_invariance/batch_cost.py` at commit 637ed2c);
`TransformerScorer(batch_invariant=False)` skips it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROW_CHUNK = 32  # the most rows oneDNN's bfloat16 matmul computes with its one-row kernel
CHUNKED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RowGroup:
    """One session's rows in a batched linear layer's input (consecutive, in session order).

    rows:  its rows here.
    alone: the rows the same layer has in the session's forward alone (more than `rows` for a
           dense forward, which also feeds its padding slots).
    """

    rows: int
    alone: int


@dataclass(frozen=True)
class RowPlan:
    """How a linear layer computes one row grouping: the rows of the small groups (forwards
    alone of at most `ROW_CHUNK` rows) and the row ranges of the large ones."""

    rows: int
    small: torch.Tensor | None  # None: the small rows are all rows (no large group)
    large: tuple[tuple[int, int], ...]  # (first row, rows) of each large group

    @classmethod
    def of(cls, groups: tuple[RowGroup, ...]) -> RowPlan:
        small: list[torch.Tensor] = []
        large = []
        start = 0
        for group in groups:
            if group.alone <= ROW_CHUNK:
                small.append(torch.arange(start, start + group.rows))
            else:
                large.append((start, group.rows))
            start += group.rows
        index = torch.cat(small) if small and large else None
        return cls(start, index, tuple(large))


class RowLayout:
    """The row groups of a batched forward: of every token row, and of the kept (logit) rows;
    each grouping's `RowPlan` is made once per forward, not once per linear layer."""

    def __init__(self, tokens: tuple[RowGroup, ...], kept: tuple[RowGroup, ...]) -> None:
        self.plans = {"tokens": RowPlan.of(tokens), "kept": RowPlan.of(kept)}


_LAYOUT: ContextVar[RowLayout | None] = ContextVar("dsbd_row_layout", default=None)


@contextlib.contextmanager
def rows_as_alone(layout: RowLayout) -> Iterator[None]:
    """Within the block, `RowChunkedLinear` layers compute each group as its forward alone."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


class RowChunkedLinear(nn.Linear):
    """An `nn.Linear` that, inside `rows_as_alone`, computes every row group in a call of the
    size class its forward alone has (see the module docstring)."""

    rows_kind = "tokens"  # "kept" for an output layer (it sees only the rows whose logits count)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        if (
            input.device.type != "cpu"
            or input.dtype not in CHUNKED_DTYPES
            or torch.compiler.is_compiling()  # a compiled step: Inductor picks the kernels
        ):
            return F.linear(input, self.weight, self.bias)
        layout = _LAYOUT.get()
        if layout is None:
            return self._linear(input)
        plan = layout.plans[self.rows_kind]
        rows = input.numel() // max(input.shape[-1], 1)
        if rows != plan.rows:
            raise AssertionError(f"{rows} rows for a layout of {plan.rows}: the layout is stale")
        flat = input.reshape(rows, input.shape[-1])
        return self._planned(flat, plan).view(*input.shape[:-1], -1)

    def _planned(self, flat: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """[rows, in] -> [rows, out]: the small groups' rows together in calls of `ROW_CHUNK`
        rows (a row's bits do not depend on which rows share a call of 1 to 32), each large
        group in a call of its own of more than `ROW_CHUNK` rows."""
        if not plan.large:  # the usual batch: small sessions only
            return torch.cat([self._linear(c) for c in flat.split(ROW_CHUNK)])
        out = flat.new_empty(plan.rows, self.out_features)
        for start, rows in plan.large:
            part = flat[start : start + rows]
            if rows <= ROW_CHUNK:  # its dense forward alone had padding rows: pad this call too
                zeros = flat.new_zeros(ROW_CHUNK + 1 - rows, flat.shape[1])
                out[start : start + rows] = self._linear(torch.cat([part, zeros]))[:rows]
            else:
                out[start : start + rows] = self._linear(part)
        if plan.small is not None:
            index = plan.small.to(flat.device)
            chunks = flat.index_select(0, index).split(ROW_CHUNK)
            out[index] = torch.cat([self._linear(c) for c in chunks])
        return out

    def _linear(self, rows: torch.Tensor) -> torch.Tensor:
        packed = self._packed_weight()
        if packed is None:
            return F.linear(rows, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(rows, packed, self.bias, "none", [], "")

    def _packed_weight(self) -> torch.Tensor | None:
        """The weight reordered once into oneDNN's blocked layout (inference only: no autograd
        through it; made again if the weight changes), or None where it does not apply."""
        if torch.is_grad_enabled() or not _onednn_reorders(self.weight.dtype):
            return None
        if type(self.weight.data) is not torch.Tensor:  # a sharded (DTensor) or wrapped weight
            return None
        key = (self.weight.data_ptr(), self.weight._version)
        cached = self.__dict__.get("_dsbd_packed")
        if cached is None or cached[0] != key:
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()))
            self.__dict__["_dsbd_packed"] = cached
        return cached[1]


def _onednn_reorders(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of this dtype on this CPU (its bfloat16/float16
    kernels need AVX512 or AVX-NE-CONVERT; elsewhere `F.linear` computes them)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def chunk_linear_rows(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of the model a `RowChunkedLinear` (in place: same weights,
    same state dict); returns how many. Idempotent."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowChunkedLinear
            changed += 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]  # hasattr-checked PreTrainedModel method
    head = getattr(head, "proj", head)  # a restricted draft head computes through `proj`
    if isinstance(head, RowChunkedLinear):
        head.rows_kind = "kept"
    return changed
