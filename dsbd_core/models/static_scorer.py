"""The static-shape decode path: a `TransformerScorer` whose forwards are fixed-shape steps over
a preallocated KV pool, so that on CUDA each bucket runs as one captured graph.

What differs from the dynamic path (`TransformerScorer`), and what does not:

* Layers on the host take the same forward layout (`forest_plan`: per tree row, the root's
  uncached tokens then the tree's nodes, packed, the same tree mask, the same positions), and
  the same cache layout: column j of a row holds the j-th token fed to it. Only where the
  columns live differs: in rows of a `StaticKV` pool, written in place, instead of a
  `DynamicCache` grown by concatenation. Compaction after verification (ALGORITHM.md §6.4) is
  the same plan (`kv_cache.plan_compaction`), done as one gather inside the pool.
* Layers the engine left on a device are laid out there (`slot_layout`): every layer's slots
  in every row, a slot real in its tree's row only, so that no forward waits to learn which
  nodes exist; the shape of a draft step or a verify is fixed by W_S and gamma alone (a
  bucket per config). Same masks, positions and log-probs; a DSBD iteration then waits once,
  for the engine's planning read (tests/models/test_slot_layout.py).
* A forward runs as a bucket `[rows, slots]` of the ladder (`static_step`): the rows of the pool
  from 0 up to the highest row of a session in the forward (rounded up to a power of two), and
  the most slots any of its trees needs (rounded up to 1, 2, 4, ..., 32). Padding slots and rows
  of sessions not in the forward attend only to themselves and write to scratch columns or past
  their session's columns; their outputs are never read. Forwards larger than the ladder (a
  prompt's prefill) run per session, eagerly, at their own shape.
* Several sessions batched together share one bucket (continuous batching keeps working), but
  a session's last bits then depend on the bucket its batch mates choose: the linear layers run
  over more rows and the kernels (cuBLAS, oneDNN) pick by shape. The dynamic path's row
  chunking (`row_chunks`, batch invariance by split calls) is not used here: it multiplies
  kernel launches. So on this path a seeded decode is reproducible alone, and batched only up
  to those last bits (what vLLM and SGLang give without their batch-invariant kernels);
  `dsbd serve` says so in its status. A decode alone equals the dynamic path's tokens where the
  arithmetic is exact enough (float64, float32 on the models tested), not bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from dsbd_core.algorithm.draws.host_reads import may_read
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs
from dsbd_core.models.draft_variants import compact_logits
from dsbd_core.models.forest_plan import ForestPlan, record_plan, scatter_outputs
from dsbd_core.models.kv_cache import SessionCache, plan_compaction
from dsbd_core.models.slot_layout import SlotPlan, gather_outputs, plan_slots, record_slots
from dsbd_core.models.static_cache import SlotHandle, StaticKV, to_device
from dsbd_core.models.static_side import SideSessions
from dsbd_core.models.static_step import (
    SLOT_BUCKETS,
    CompileMode,
    StaticInputs,
    StaticStep,
    bucket,
    idle_inputs,
    row_buckets,
    static_attention_for,
)
from dsbd_core.models.transformer_scorer import (
    TransformerScorer,
    session_roots,
    uncached_session,
)

LENGTH_QUANTUM = 128  # pool columns grow in multiples of this (fewer regrowths, same graphs)


def default_compile(device: torch.device | str) -> CompileMode:
    """CUDA graphs on CUDA, captured from the eager step (milliseconds per bucket, where
    `torch.compile` takes tens of seconds per bucket and model: a ladder of 18 buckets would
    delay every start by minutes); eager elsewhere (a CPU forward is bound by its arithmetic,
    not by launches; Inductor took 92 s to compile one bucket of a 2-layer model here)."""
    return "cuda-graph" if torch.device(device).type == "cuda" else "none"


class StaticScorer(TransformerScorer):
    """A `ForestScorer` on the static-shape path (see the module docstring).

    rows / length: the pool's initial rows and session columns (it grows when a batch needs
    more, up to `max_rows` rows, then evicts the least recently used exported sessions);
    compile: how buckets run (`static_step.COMPILE_MODES`; default per device).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        rows: int = 0,
        length: int = 0,
        max_rows: int = 256,
        compile: CompileMode | None = None,
    ) -> None:
        super().__init__(model, pack=False, batch_invariant=False)
        self.compile = compile if compile is not None else default_compile(model.device)
        self.max_rows = max_rows
        self._initial = (rows, length)
        self._pool: StaticKV | None = None
        self._step: StaticStep | None = None
        self._busy: set[int] = set()  # pool bases of the batch being started (never evicted)
        self._side: SideSessions | None = None  # the side whose graph runs the forwards
        self._rooted = False  # `prepare_side` started this iteration: `set_roots` is done
        if rows and length:
            self._ensure_pool(rows, length)

    # ------------------------------------------------------------------ pool and graphs

    def _ensure_pool(self, rows: int, length: int) -> StaticKV:
        length = -(-length // LENGTH_QUANTUM) * LENGTH_QUANTUM
        if self._pool is None:
            text = self.model.config.get_text_config(decoder=True)
            heads = text.num_attention_heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
            self._pool = StaticKV(
                text.num_hidden_layers,
                text.num_key_value_heads or heads,
                head_dim,
                rows=max(rows, self._initial[0], 1),
                length=max(length, self._initial[1]),
                scratch=SLOT_BUCKETS[-1],
                dtype=self.model.dtype,
                device=self.model.device,
            )
            self._step = StaticStep(self.model, self._pool, self.compile, self._out_dtype)
        elif length > self._pool.length:
            self._pool.grow(length=max(length, 2 * self._pool.length))
        return self._pool

    def capture(self, rows: int, length: int, slots: Sequence[int] = SLOT_BUCKETS) -> dict:
        """Allocate the pool and run every bucket once (compiling and, on CUDA, recording its
        graph) so that no request pays for it; returns the status (`status`)."""
        pool = self._ensure_pool(rows, length)
        assert self._step is not None
        for row_count in row_buckets(pool.rows):
            for slot_count in slots:
                self._step(idle_inputs(pool, row_count, slot_count), bucketed=True)
        return self.status()

    def status(self) -> dict:
        """The ladder, capture time, graph and pool memory, and counters (for `/v1/dsbd/status`
        and the start-up line)."""
        if self._step is None:
            return {"path": "static", "compile": self.compile, "pool_rows": 0}
        self._step._refresh()
        return {"path": "static", **self._step.stats.as_dict()}

    # ------------------------------------------------------------------ ForestScorer API

    def set_roots(self, roots) -> None:  # noqa: ANN001 (Roots, as the base class)
        """Start an iteration (compacting in the pool); frees the rows of sessions that end.
        After `prepare_side` it only says that the roots' log-probs are due: done there."""
        if self._rooted:
            self._rooted = False
            self._roots_pending = True
            return
        before = [s for s in self._sessions if s is not None]
        batch, root_count, capacity = roots.tokens.shape
        self._ensure_pool(batch * root_count, capacity + 1)
        self._busy = {s.cache.base for s in before if isinstance(s.cache, SlotHandle)}
        super().set_roots(roots)
        kept = {id(s.cache) for s in self._sessions if s is not None}
        for session in before:
            if id(session.cache) not in kept:
                self._free(session)

    # ------------------------------------------------------------------ a side's graph

    def prepare_side(self, roots, depth: int) -> bool:  # noqa: ANN001 (Roots)
        """Before a side's graph (`side_graphs.PreparedScorer`): start the iteration
        (`set_roots`: compaction in the pool), grow the pool to hold `depth` layers' slots
        more, copy the side's metadata to the device (`static_side`). False where the side
        cannot run inside a graph this iteration (the layout is the host's, or a session would
        be a new shape): its calls are then driven as usual."""
        self.set_roots(roots)
        self._rooted, self._side = True, None
        if self._step is None or self._result_device != self.model.device:
            return False
        live = [s for s in self._sessions if s is not None]
        if any(s.cached_cols != s.prefix_cols for s in live):  # nodes cached before roots
            return False
        need = max((s.length for s in live), default=0) + (depth + 1) * SLOT_BUCKETS[-1]
        self._ensure_pool(0, need)
        self._step._refresh()
        assert self._pool is not None  # _ensure_pool made it
        self._side = SideSessions.prepare(
            self._pool, self._step._eager, self._sessions, self._root_count
        )
        return self._side is not None

    def side_context(self) -> contextlib.AbstractContextManager:
        """What a side's graph runs in: no autograd, the static attention, the restricted
        head's logits (as `StaticStep` runs a step)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(static_attention_for(self.model))
        stack.enter_context(compact_logits(self.model))
        return stack

    def scored(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        """A forward inside a prepared side's graph (`GraphScorer`): reads nothing, changes
        no host counter (the engine counts the side's forwards)."""
        side = self._side
        if side is None:
            raise RuntimeError("scored outside a prepared side (prepare_side)")
        support, roots, outs = self._output_buffers(layers, self.model.device)
        side.forward(layers, roots, outs)
        self._roots_pending = False
        return ForestLogprobs(roots=roots, layers=outs, support=support)

    def finish_side(self) -> None:
        """After a side's graph: the host's record of what the forwards fed (`static_side`)."""
        if self._side is not None:
            self._side.finish(self._sessions)
            self._side = None

    def release(self) -> None:
        for session in self._sessions:
            self._free(session)
        super().release()

    def discard_sessions(self, sessions: list[SessionCache | None]) -> None:
        """Sessions a `SessionBatcher` dropped (ended, expired, evicted): their rows are free."""
        for session in sessions:
            self._free(session)

    def _free(self, session: SessionCache | None) -> None:
        if session is not None and self._pool is not None:
            handle = session.cache
            if isinstance(handle, SlotHandle):
                self._pool.free(handle)

    # ------------------------------------------------------------------ internals

    @property
    def _device(self) -> torch.device:
        """Where the packed layout is planned: the host (its shapes depend on which nodes
        exist: on a GPU that would be a synchronisation per forward). The model's device gets
        one copy of a step's inputs. Layers already on a device take the slot layout there
        instead (`_plan_and_run`)."""
        return torch.device("cpu")

    @property
    def _result_device(self) -> torch.device:
        """The log-probs stay on the model's device when the engine lives there too
        (`engine_device`): then no vocabulary-wide row crosses to the host. An engine on the
        host (a serving replica's) gets them in one gather and one copy."""
        model_device = self.model.device
        return model_device if self._out_device == model_device else self._device

    def _start_session(
        self,
        b: int,
        tokens: torch.Tensor,
        length: int,
        alive: torch.Tensor,
        origin,  # noqa: ANN001 (Origin | None)
        old: SessionCache | None,
    ) -> SessionCache | None:
        """The session's rows for a new iteration: compacted in place, or ready to re-prefill."""
        assert self._pool is not None
        roots = session_roots(b, tokens, length, alive)
        if roots is None:
            return None
        rows, root_tokens = roots
        handle = old.cache if old is not None and self._pool.valid(old.cache) else None
        if origin is not None and handle is not None and old is not None:
            plan = plan_compaction(old, root_tokens, origin.root[b, rows], origin.path[b, rows])
            if plan is not None:
                self._pool.compact(handle, plan, old.cached_cols)
                self._pool.touch(handle.base)
                kept = plan.column_tokens
                return SessionCache(rows, root_tokens, handle, kept, kept.shape[1])
        if handle is None or handle.count < self._root_count:
            handle = self._pool.allocate(self._root_count, busy=self._busy, max_rows=self.max_rows)
            self._busy.add(handle.base)
        return uncached_session(rows, root_tokens, handle)

    def _plan_and_run(
        self, layers: Sequence[ForestLayer], roots: torch.Tensor | None, outs: list[torch.Tensor]
    ) -> None:
        """Layers the engine left on a device are laid out there (`slot_layout`: no wait for
        their values). Layers on the host, where reading is free, and a call with no layer (a
        beam step: planned from the roots' host copy, then one copy of the inputs) take the
        packed host layout."""
        device = self.model.device
        if not layers or may_read(layers[0].token) or self._result_device != device:
            super()._plan_and_run(layers, roots, outs)
            return
        layers = [
            ForestLayer(*(to_device(t, device) for t in (x.parent, x.token, x.exists)))
            for x in layers
        ]
        plans = [
            (b, session, plan_slots(b, session, layers, self._root_count, device))
            for b, session in enumerate(self._sessions)
            if session is not None
        ]
        work = [item for item in plans if item[2].width > 0]  # else: nothing to feed
        if work:
            self._run_work(work, roots, outs)

    def _run_work(
        self,
        work: Sequence[tuple[int, SessionCache, ForestPlan | SlotPlan]],
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """One bucketed forward of every session of the call, or eager ones for prefills."""
        assert self._pool is not None and self._step is not None
        slots = bucket(max(plan.input_ids.shape[1] for _, _, plan in work), SLOT_BUCKETS)
        if slots is None:  # larger than the ladder: each session at its own shape
            for item in work:
                self._forward([item], None, roots, outs)
            return
        self._forward(work, slots, roots, outs)

    def _forward(
        self,
        work: Sequence[tuple[int, SessionCache, ForestPlan | SlotPlan]],
        slots: int | None,
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        pool = self._pool
        assert pool is not None and self._step is not None
        width = slots or max(plan.input_ids.shape[1] for _, _, plan in work)
        need = max(session.cached_cols for _, session, _ in work) + width
        self._ensure_pool(0, need)
        top = max(s.cache.base + s.rows.numel() for _, s, _ in work)
        rows = bucket(top, row_buckets(pool.rows)) if slots else None
        inputs = _inputs(pool, work, rows, width)
        self.forward_calls += 1
        first = 0 if slots else work[0][1].cache.base
        logprobs = self._step(inputs, bucketed=slots is not None, first=first)
        if isinstance(work[0][2], SlotPlan):
            for b, session, plan in work:
                base = session.cache.base - first
                gather_outputs(b, session, plan, logprobs, base, roots, outs)  # type: ignore[arg-type]  # work holds SlotPlans only (checked above)
                record_slots(session, session.cache, plan)  # type: ignore[arg-type]  # work holds SlotPlans only (checked above)
        else:
            _place_outputs(work, logprobs, first, roots, outs, self._out_dtype)  # type: ignore[arg-type]  # work holds ForestPlans only
            for _, session, plan in work:
                record_plan(session, session.cache, plan)  # type: ignore[arg-type]  # work holds ForestPlans only
        for _, session, _ in work:
            pool.touch(session.cache.base)


def _place_outputs(
    work: list[tuple[int, SessionCache, ForestPlan]],
    logprobs: torch.Tensor,
    first: int,
    roots: torch.Tensor | None,
    outs: list[torch.Tensor],
    dtype: torch.dtype,
) -> None:
    """Write every session's root and node log-probs from the step's output.

    Where each output row comes from is worked out on the host (`scatter_outputs` run on the
    indices of the kept slots instead of their values); the indices then cross to the device
    in one asynchronous copy, the rows are taken in one gather, and each output gets them in one
    `index_copy_`. So a call with the engine beside the model neither waits for the device nor
    moves a vocabulary-wide row; with the engine on the host the rows cross in one copy.
    """
    targets = ([roots] if roots is not None else []) + outs
    if not targets:
        return
    sources = [torch.full(t.shape[:2] + (1,), -1, dtype=torch.long) for t in targets]
    row_of, slot_of, kept = [], [], 0
    for b, session, plan in work:
        row, slot = plan.keep.nonzero(as_tuple=True)  # row-major, as `rank` counts
        row_of.append(row + session.cache.base - first)
        slot_of.append(slot)
        rank = plan.keep.flatten().cumsum(0).view_as(plan.keep) - 1
        ids = (kept + torch.arange(row.numel()))[:, None]
        src_roots = sources[0] if roots is not None else None
        scatter_outputs(b, session, plan, ids, rank, src_roots, sources[len(targets) - len(outs) :])
        kept += row.numel()
    flat_rows, flat_slots = torch.cat(row_of), torch.cat(slot_of)
    dests, picks = [], []
    for source in sources:
        flat = source.flatten()
        dest = (flat >= 0).nonzero().flatten()
        dests.append(dest)
        picks.append(flat[dest])
    pick = torch.cat(picks)
    device = logprobs.device
    on_device = targets[0].device == device
    moved = to_device(
        torch.cat([flat_rows[pick], flat_slots[pick]] + (dests if on_device else [])), device
    )
    count = pick.numel()
    values = logprobs[moved[:count], moved[count : 2 * count]].to(targets[0].device, dtype)
    if on_device:
        dests = list(moved[2 * count :].split([d.numel() for d in dests]))
    for target, dest, chunk in zip(
        targets, dests, values.split([d.numel() for d in dests]), strict=True
    ):
        target.view(-1, target.shape[-1]).index_copy_(0, dest, chunk)


def _inputs(
    pool: StaticKV,
    work: Sequence[tuple[int, SessionCache, ForestPlan | SlotPlan]],
    rows: int | None,
    slots: int,
) -> StaticInputs:
    """The step's inputs: every session's plan placed at its pool rows, the rest idle.

    `rows` None: an eager forward of one session over exactly its own rows. Host plans are
    placed on the host and copied to the device once; slot plans are placed on the device.
    """
    device = pool.device
    first = 0 if rows is not None else work[0][1].cache.base
    count = rows if rows is not None else work[0][1].rows.numel()
    columns = pool.length + pool.scratch
    host = device if isinstance(work[0][2], SlotPlan) else torch.device("cpu")
    inputs = (
        idle_inputs(pool, count, slots, host)
        if rows is not None
        else StaticInputs(
            torch.zeros(count, slots, dtype=torch.long, device=host),
            torch.zeros(count, slots, dtype=torch.long, device=host),
            torch.zeros(count, slots, dtype=torch.long, device=host),
            torch.zeros(count, slots, columns, dtype=torch.bool, device=host),
        )
    )
    span = torch.arange(slots, device=host)
    for _, session, plan in work:
        base = session.cache.base - first
        n, q = plan.input_ids.shape
        cached = session.cached_cols
        block = slice(base, base + n)
        inputs.input_ids[block] = 0
        inputs.input_ids[block, :q] = plan.input_ids.to(host)
        inputs.position_ids[block] = 0
        inputs.position_ids[block, :q] = plan.position_ids.to(host)
        inputs.write[block] = cached + span  # padding slots write past the session's columns
        inputs.allowed[block] = False
        inputs.allowed[block, :q, : cached + q] = plan.allowed.to(host)
        inputs.allowed[block, span[q:], cached + span[q:]] = True  # a padding slot sees itself
    return StaticInputs(
        *(
            to_device(x, device)
            for x in (inputs.input_ids, inputs.position_ids, inputs.write, inputs.allowed)
        )
    )


def static_forward_costs(
    model: PreTrainedModel, points: Sequence[int], repeats: int, context: int
) -> list[float]:
    """Median seconds of a static-path forward feeding n tokens after `context` cached
    columns, one row (the calibration of the cost model on this path: `calibrate`)."""
    import time

    scorer = StaticScorer(model, rows=1, length=context + max(points))
    pool, step = scorer._pool, scorer._step
    assert pool is not None and step is not None
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    seconds = []
    for n in points:
        slots = bucket(n, SLOT_BUCKETS)
        width = slots or n
        span = torch.arange(width)
        allowed = torch.zeros(1, width, pool.length + pool.scratch, dtype=torch.bool)
        allowed[0] = torch.arange(allowed.shape[2])[None, :] <= context + span[:, None]
        ids = (torch.arange(width) * 7919 % min(vocab, 1000))[None]
        inputs = StaticInputs(
            *(x.to(pool.device) for x in (ids, context + span[None], context + span[None], allowed))
        )
        times = []
        for _ in range(repeats + 1):  # the first run warms up (and compiles, records)
            _synchronize(pool.device)
            start = time.perf_counter()
            step(inputs, bucketed=slots is not None)
            _synchronize(pool.device)
            times.append(time.perf_counter() - start)
        seconds.append(sorted(times[1:])[len(times[1:]) // 2])
    return seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
