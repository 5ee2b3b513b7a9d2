"""One model forward of fixed shape over the static KV pool: the step that graphs capture.

A step feeds `[rows, slots]` tokens (a bucket of the ladder: rows of the pool from 0, slots per
row) with explicit positions, a boolean mask `[rows, slots, columns]` over the whole pool row
and, per slot, the pool column its keys and values are written to. Inside, every attention
layer writes the new keys and values into the pool in place (`scatter_` at the write columns:
per-row positions, so rows of sessions of different lengths share a step) and attends over the
pool row under the mask with the model's own attention function (`sdpa` or `eager`, as the
dynamic path's dense forward does). The output is the log-softmax at every slot.

Every shape in a step is a function of its bucket, and every tensor it touches is either an
input of that shape or the pool itself (a static address): that is what lets
`torch.compile(mode="reduce-overhead", fullgraph=True)` capture one CUDA graph per bucket and
replay it, and what `tests/test_static_path.py` checks on CPU (`fullgraph=True`, no break).

The ladder: slots per row in `SLOT_BUCKETS` (a beam step is 1; a forest of depth gamma over W_S
draft beams needs 1 + gamma * W_S at most), rows in powers of two up to the pool's. A forward
with more slots than the largest bucket (a prompt's prefill) runs the same function eagerly at
its own shape.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dsbd_core.models.static_cache import StaticKV

NAME = "dsbd_static"
SLOT_BUCKETS = (1, 2, 4, 8, 16, 32)
CompileMode = str  # "none" | "default" | "reduce-overhead" (torch.compile modes)
COMPILE_MODES = ("none", "default", "reduce-overhead")


@dataclass
class StaticInputs:
    """What one step reads besides the pool (all of the bucket's shape)."""

    input_ids: torch.Tensor  # [rows, slots] long
    position_ids: torch.Tensor  # [rows, slots] long
    write: torch.Tensor  # [rows, slots] long: the pool column each slot's K/V go to
    allowed: torch.Tensor  # [rows, slots, columns] bool


@dataclass
class _Spec:
    """Passed through the model's forward to `static_attention` (transformers forwards extra
    keyword arguments to the attention function)."""

    pool: StaticKV
    write: torch.Tensor
    implementation: str
    first: int  # the pool row of the forward's row 0 (0 for every bucket)


def static_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [rows, heads, slots, dim], key/value [rows, kv_heads, slots, dim] -> the attention
    output [rows, slots, heads, dim], after writing key/value into the pool in place."""
    spec = kwargs[NAME]
    assert isinstance(spec, _Spec)
    layer = module.layer_idx  # type: ignore[attr-defined]
    rows = query.shape[0]
    keys = spec.pool.keys(layer)[spec.first : spec.first + rows]
    values = spec.pool.values(layer)[spec.first : spec.first + rows]
    index = spec.write[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
    keys.scatter_(2, index, key.to(keys.dtype))
    values.scatter_(2, index, value.to(values.dtype))
    attend = (
        sys.modules[type(module).__module__].eager_attention_forward
        if spec.implementation == "eager"
        else ALL_ATTENTION_FUNCTIONS[spec.implementation]
    )  # what the model's attention layer calls for its own implementation
    out, _ = attend(module, query, keys, values, attention_mask, dropout=0.0, scaling=scaling)
    return out, None


AttentionInterface.register(NAME, static_attention)


@contextlib.contextmanager
def static_attention_for(model: PreTrainedModel) -> Iterator[str]:
    """Within the block the model's attention is `static_attention`; yields the model's own
    implementation (restored afterwards)."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}
    before = {key: c._attn_implementation for key, c in configs.items()}
    own = model.config.get_text_config(decoder=True)._attn_implementation
    try:
        for c in configs.values():
            c._attn_implementation = NAME
        yield own
    finally:
        for key, c in configs.items():
            c._attn_implementation = before[key]


def step_function(
    model: PreTrainedModel, pool: StaticKV, implementation: str, out_dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The forward of one bucket as a function of its inputs only (the pool is closed over)."""
    min_value = torch.finfo(model.dtype).min

    def step(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write: torch.Tensor,
        allowed: torch.Tensor,
        first: int = 0,
    ) -> torch.Tensor:
        bias = torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device)
        bias = bias.masked_fill(~allowed, min_value)[:, None]
        output = model(
            input_ids=input_ids,
            attention_mask=bias,  # 4-D: transformers hands it on untouched
            position_ids=position_ids,
            use_cache=False,
            **{NAME: _Spec(pool, write, implementation, first)},
        )
        return torch.log_softmax(output.logits, dim=-1, dtype=out_dtype)

    return step


@dataclass
class StepStats:
    """What `/v1/dsbd/status` and the start-up line report of a model's static path."""

    compile: str
    device: str
    slot_buckets: tuple[int, ...]
    row_buckets: tuple[int, ...] = ()
    captured: list[str] = field(default_factory=list)  # "rows x slots" buckets run so far
    capture_s: float = 0.0  # time spent on first calls of buckets (compiling, recording)
    graph_memory_bytes: int = 0  # device memory the captured buckets took (CUDA)
    pool_bytes: int = 0
    pool_rows: int = 0
    pool_length: int = 0
    regrowths: int = 0
    eager_forwards: int = 0  # forwards larger than the ladder (prefills), run eagerly
    bucket_forwards: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "compile": self.compile, "device": self.device,
            "slot_buckets": list(self.slot_buckets), "row_buckets": list(self.row_buckets),
            "captured": list(self.captured), "capture_s": round(self.capture_s, 3),
            "graph_memory_mib": round(self.graph_memory_bytes / 2**20, 1),
            "pool_mib": round(self.pool_bytes / 2**20, 1), "pool_rows": self.pool_rows,
            "pool_length": self.pool_length, "regrowths": self.regrowths,
            "eager_forwards": self.eager_forwards, "bucket_forwards": self.bucket_forwards,
        }  # fmt: skip


def row_buckets(rows: int) -> tuple[int, ...]:
    """Powers of two below `rows`, then `rows` itself."""
    out, size = [], 1
    while size < rows:
        out.append(size)
        size *= 2
    return (*out, rows)


def bucket(value: int, ladder: tuple[int, ...]) -> int | None:
    """The smallest rung >= value, or None above the ladder."""
    return next((rung for rung in ladder if rung >= value), None)


class StaticStep:
    """Runs fixed-shape forwards over one pool: compiled per bucket, or eagerly.

    `compile`: "none" (eager: the same function, for CPU and for checking), "default"
    (`torch.compile`, Inductor kernels) or "reduce-overhead" (CUDA graphs over Inductor
    kernels, one per bucket). A regrown pool gets a fresh compiled function: graphs hold
    the old pool's addresses.
    """

    def __init__(
        self, model: PreTrainedModel, pool: StaticKV, compile: CompileMode, out_dtype: torch.dtype
    ) -> None:
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r}: allowed: {', '.join(COMPILE_MODES)}")
        self.model, self.pool, self.compile, self.out_dtype = model, pool, compile, out_dtype
        self.stats = StepStats(compile, str(pool.device), SLOT_BUCKETS)
        self._data_ptr = -1
        self._eager: Callable[..., torch.Tensor] | None = None
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._seen: set[tuple[int, int]] = set()

    def __call__(self, inputs: StaticInputs, *, bucketed: bool, first: int = 0) -> torch.Tensor:
        """log-probs [rows, slots, V] of one forward (`bucketed`: a shape of the ladder, over
        the pool's rows from 0; else eager over the rows from `first`)."""
        self._refresh()
        rows, slots = inputs.input_ids.shape
        with torch.inference_mode(), static_attention_for(self.model):
            if not bucketed or self._compiled is None:
                self.stats.eager_forwards += not bucketed
                self.stats.bucket_forwards += bucketed
                assert self._eager is not None
                return self._eager(inputs.input_ids, inputs.position_ids, inputs.write,
                                   inputs.allowed, first)  # fmt: skip
            self.stats.bucket_forwards += 1
            first = (rows, slots) not in self._seen
            if first:
                return self._first_call(inputs)
            out = self._compiled(inputs.input_ids, inputs.position_ids, inputs.write,
                                 inputs.allowed)  # fmt: skip
            return out.clone() if self.compile == "reduce-overhead" else out

    def _first_call(self, inputs: StaticInputs) -> torch.Tensor:
        """A bucket's first calls compile it (and, on CUDA, record its graph): timed."""
        assert self._compiled is not None
        rows, slots = inputs.input_ids.shape
        cuda = self.pool.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.pool.device)
            before = torch.cuda.memory_reserved(self.pool.device)
        start = time.perf_counter()
        calls = 3 if self.compile == "reduce-overhead" else 1  # warm-up, record, replay
        for _ in range(calls):
            out = self._compiled(inputs.input_ids, inputs.position_ids, inputs.write,
                                 inputs.allowed)  # fmt: skip
        if cuda:
            torch.cuda.synchronize(self.pool.device)
            self.stats.graph_memory_bytes += torch.cuda.memory_reserved(self.pool.device) - before
        self.stats.capture_s += time.perf_counter() - start
        self._seen.add((rows, slots))
        self.stats.captured.append(f"{rows}x{slots}")
        return out.clone() if self.compile == "reduce-overhead" else out

    def _refresh(self) -> None:
        """(Re)build the step functions for the current pool storage."""
        pool = self.pool
        self.stats.pool_bytes, self.stats.pool_rows = pool.nbytes, pool.rows
        self.stats.pool_length, self.stats.regrowths = pool.length, pool.regrowths
        self.stats.row_buckets = row_buckets(pool.rows)
        if pool.data.data_ptr() == self._data_ptr:
            return
        self._data_ptr = pool.data.data_ptr()
        implementation = self.model.config.get_text_config(decoder=True)._attn_implementation
        if implementation == NAME:  # called inside static_attention_for
            raise RuntimeError("StaticStep refreshed inside its own attention block")
        self._eager = step_function(self.model, pool, implementation, self.out_dtype)
        self._seen.clear()
        self._compiled = None
        if self.compile != "none":
            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit,
                4 * len(SLOT_BUCKETS) * len(self.stats.row_buckets),
            )
            self._compiled = torch.compile(
                step_function(self.model, pool, implementation, self.out_dtype),
                mode=None if self.compile == "default" else self.compile,
                fullgraph=True,
                dynamic=False,
            )
