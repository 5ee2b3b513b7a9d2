"""One model forward of fixed shape over the static KV pool: the step that graphs capture.

A step feeds `[rows, slots]` tokens (a bucket of the ladder: rows of the pool from 0, slots per
row) with explicit positions, a boolean mask `[rows, slots, columns]` over the whole pool row
and, per slot, the pool column its keys and values are written to. Inside, every attention
layer writes the new keys and values into the pool in place (`scatter_` at the write columns:
per-row positions, so rows of sessions of different lengths share a step) and attends over the
pool row under the mask with the model's own attention function (`sdpa` or `eager`, as the
dynamic path's dense forward does). The output is the log-softmax at every slot.

Every shape in a step is a function of its bucket, and every tensor it touches is either an input of
that shape or the pool itself (a static address): that is what lets `torch.cuda.CUDAGraph` capture
one graph per bucket and replay it (or `torch.compile(mode="reduce-overhead", fullgraph=True)`
compile one), and what `tests/models/test_static_path.py` checks on CPU
(`torch.compile(fullgraph=True)`: no graph break, so no host synchronisation and no data-dependent
shape inside a step).

The ladder: slots per row in `SLOT_BUCKETS` (a beam step is 1; a forest of depth gamma over W_S
draft beams needs 1 + gamma * W_S at most), rows in powers of two up to the pool's. A forward
with more slots than the largest bucket (a prompt's prefill) runs the same function eagerly at
its own shape.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel

from dsbd_core.models.draft_variants import compact_logits
from dsbd_core.models.forest_attention import own_attention
from dsbd_core.models.static_cache import StaticKV

NAME = "dsbd_static"
SLOT_BUCKETS = (1, 2, 4, 8, 16, 32)
CompileMode = str  # one of COMPILE_MODES
# none: eager. cuda-graph: each bucket's eager step captured once as a `torch.cuda.CUDAGraph`
# (milliseconds per bucket). default / reduce-overhead: `torch.compile` per bucket (Inductor
# kernels; reduce-overhead replays them as CUDA graphs), tens of seconds per bucket per model.
# inductor-graph: Inductor's fused kernels (`torch.compile`, default mode) captured by the same
# `torch.cuda.CUDAGraph` as cuda-graph: fewer, fused kernels in one replay, without relying on
# torch.compile's own graph trees (which skip a graph whose inputs, the KV pool, it mutates).
COMPILE_MODES = ("none", "cuda-graph", "default", "reduce-overhead", "inductor-graph")
CAPTURED = ("cuda-graph", "reduce-overhead", "inductor-graph")  # CUDA only


# Forwards run as captured-graph replays, per model. A replay runs no Python `forward`, so the
# model's forward hooks (what `dsbd bench` counts passes with) never see it: they read this.
_REPLAYS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def replayed_forwards(model: torch.nn.Module) -> int:
    """How many forwards of `model` ran as captured-graph replays (no forward hook fired)."""
    return _REPLAYS.get(model, 0)


def note_replay(model: torch.nn.Module) -> None:
    """Count one replayed forward of `model` (`replayed_forwards`)."""
    _REPLAYS[model] = _REPLAYS.get(model, 0) + 1


# Models whose bucket is being captured or compiled: the forwards that do it are not decoding.
_PREPARING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def preparing(model: torch.nn.Module) -> bool:
    """Whether `model`'s forwards now capture or compile a bucket (not a decode's pass)."""
    return model in _PREPARING


@contextlib.contextmanager
def preparing_bucket(model: torch.nn.Module) -> Iterator[None]:
    """Within the block `model`'s forwards capture or compile a bucket (`preparing`)."""
    _PREPARING.add(model)
    try:
        yield
    finally:
        _PREPARING.discard(model)


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
    layer: int = module.layer_idx  # type: ignore[assignment]  # HF attention's int layer_idx
    rows = query.shape[0]
    keys = spec.pool.keys(layer)[spec.first : spec.first + rows]
    values = spec.pool.values(layer)[spec.first : spec.first + rows]
    index = spec.write[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
    keys.scatter_(2, index, key.to(keys.dtype))
    values.scatter_(2, index, value.to(values.dtype))
    attend = own_attention(module, spec.implementation)
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
            "compile": self.compile,
            "device": self.device,
            "slot_buckets": list(self.slot_buckets),
            "row_buckets": list(self.row_buckets),
            "captured": list(self.captured),
            "capture_s": round(self.capture_s, 3),
            "graph_memory_mib": round(self.graph_memory_bytes / 2**20, 1),
            "pool_mib": round(self.pool_bytes / 2**20, 1),
            "pool_rows": self.pool_rows,
            "pool_length": self.pool_length,
            "regrowths": self.regrowths,
            "eager_forwards": self.eager_forwards,
            "bucket_forwards": self.bucket_forwards,
        }


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
    """Runs fixed-shape forwards over one pool: captured per bucket, compiled, or eagerly.

    `compile` is one of `COMPILE_MODES`. Captured graphs and compiled functions hold the pool's
    address: a regrown pool gets them made again. The log-probs a captured bucket returns live
    in its graph's output buffer, valid until that bucket runs again: read them before.
    """

    def __init__(
        self, model: PreTrainedModel, pool: StaticKV, compile: CompileMode, out_dtype: torch.dtype
    ) -> None:
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r}: allowed: {', '.join(COMPILE_MODES)}")
        if compile in CAPTURED and pool.device.type != "cuda":
            raise ValueError(
                f"compile={compile!r} captures CUDA graphs: the model is on "
                f"{pool.device}; allowed there: none, default"
            )
        self.model, self.pool, self.compile, self.out_dtype = model, pool, compile, out_dtype
        self.stats = StepStats(compile, str(pool.device), SLOT_BUCKETS)
        self._data_ptr = -1
        self._eager: Callable[..., torch.Tensor] | None = None
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._buckets: dict[tuple[int, int], Callable[[StaticInputs], torch.Tensor]] = {}
        self._graph_pool: torch.cuda._POOL_HANDLE | None = None

    def __call__(self, inputs: StaticInputs, *, bucketed: bool, first: int = 0) -> torch.Tensor:
        """log-probs [rows, slots, V] of one forward (`bucketed`: a shape of the ladder, over
        the pool's rows from 0; else eager over the rows from `first`)."""
        self._refresh()
        # a restricted draft head answers over its K tokens in every step, captured ones too
        with torch.inference_mode(), static_attention_for(self.model), compact_logits(self.model):
            if not bucketed or self.compile == "none":
                self.stats.eager_forwards += not bucketed
                self.stats.bucket_forwards += bucketed
                assert self._eager is not None
                return self._eager(*_args(inputs), first)
            self.stats.bucket_forwards += 1
            shape = (inputs.input_ids.shape[0], inputs.input_ids.shape[1])  # (rows, slots)
            run = self._buckets.get(shape)
            if run is None:
                run = self._prepare(shape)
            return run(inputs)

    def _prepare(self, shape: tuple[int, int]) -> Callable[[StaticInputs], torch.Tensor]:
        """A bucket's first call: capture its graph or compile it (timed, memory counted)."""
        rows, slots = shape
        cuda = self.pool.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.pool.device)
            before = torch.cuda.memory_reserved(self.pool.device)
        start = time.perf_counter()
        idle = idle_inputs(self.pool, rows, slots)
        with preparing_bucket(self.model):
            capture = self.compile in ("cuda-graph", "inductor-graph")
            run = self._capture(idle) if capture else self._warm(idle)

        if cuda:
            torch.cuda.synchronize(self.pool.device)
            self.stats.graph_memory_bytes += torch.cuda.memory_reserved(self.pool.device) - before
        self.stats.capture_s += time.perf_counter() - start
        self.stats.captured.append(f"{rows}x{slots}")
        self._buckets[shape] = run
        return run

    def _warm(self, idle: StaticInputs) -> Callable[[StaticInputs], torch.Tensor]:
        """A compiled bucket: compiled (and, reduce-overhead, recorded) on idle inputs."""
        compiled = self._compiled
        assert compiled is not None
        for _ in range(3 if self.compile == "reduce-overhead" else 1):  # warm, record
            compiled(*_args(idle))

        def run(inputs: StaticInputs) -> torch.Tensor:
            return compiled(*_args(inputs))

        return run

    def _capture(self, idle: StaticInputs) -> Callable[[StaticInputs], torch.Tensor]:
        """One CUDA graph of the eager step at this bucket: inputs copied into its static
        buffers, one replay, the output buffer returned. Captured on idle inputs (every row
        writes to scratch columns), warmed up on a side stream first, as CUDA graphs need
        (inductor-graph: the compiled step, compiled by that warm-up)."""
        step = self._eager if self.compile == "cuda-graph" else self._compiled
        assert step is not None
        static = StaticInputs(*(x.clone() for x in _args(idle)))
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step(*_args(static))
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = step(*_args(static))

        model = self.model

        def replay(inputs: StaticInputs) -> torch.Tensor:
            for target, source in zip(_args(static), _args(inputs), strict=True):
                target.copy_(source, non_blocking=True)
            graph.replay()
            note_replay(model)
            return out

        return replay

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
        self._buckets.clear()
        self._compiled = None
        if self.compile in ("default", "reduce-overhead", "inductor-graph"):
            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit,
                4 * len(SLOT_BUCKETS) * len(self.stats.row_buckets),
            )
            self._compiled = torch.compile(
                step_function(self.model, pool, implementation, self.out_dtype),
                mode=self.compile if self.compile == "reduce-overhead" else None,
                fullgraph=True,
                dynamic=False,
            )


def _args(inputs: StaticInputs) -> tuple[torch.Tensor, ...]:
    return (inputs.input_ids, inputs.position_ids, inputs.write, inputs.allowed)


def idle_inputs(
    pool: StaticKV, rows: int, slots: int, device: torch.device | None = None
) -> StaticInputs:
    """A bucket where no row is in the forward: each slot writes and sees its scratch column
    (on `device`, default the pool's)."""
    columns = pool.length + pool.scratch
    device = device or pool.device  # built there: a copy from the host's memory could wait
    span = torch.arange(slots, device=device)
    write = (pool.length + span).expand(rows, slots).clone()
    allowed = torch.zeros(rows, slots, columns, dtype=torch.bool, device=device)
    allowed[:, span, pool.length + span] = True
    return StaticInputs(
        torch.zeros(rows, slots, dtype=torch.long, device=device),
        torch.zeros(rows, slots, dtype=torch.long, device=device),
        write,
        allowed,
    )
