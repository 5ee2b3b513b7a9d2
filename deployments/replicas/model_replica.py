"""What the draft and the verifier replicas share: one model, session caches, batched calls.

A replica loads its model once, keeps every decode session's KV cache in a `SessionBatcher`
(keyed by session id, freed on release, after a TTL, least-recently-used beyond a cap), and
answers the calls of concurrent requests in batches: a `ContinuousBatcher` collects the calls
that arrive while the previous batch runs, and the `SessionBatcher` runs them with ONE model
forward per lockstep round.
The forward runs in a worker thread so the replica keeps accepting (and queueing) calls
meanwhile; batches run one at a time.

With `tp_size > 1` the model lives in a tensor-parallel group of rank actors that the replica
owns (deployments/replicas/tp_group.py); the replica then keeps only session handles, and its
Serve health check fails as soon as a rank is lost, so that Serve replaces it.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch

from deployments.faults import fault_point
from deployments.messages import IterationCall, SideReport
from deployments.observability.tracing import BatchSpans, replica_id
from deployments.replicas.allocator import (
    active_allocator,
    allocator_stats,
    primitive_cache_capacity,
)
from deployments.replicas.continuous_batch import ContinuousBatcher
from deployments.replicas.memory import device_free_bytes, kv_bytes_per_token, replica_memory
from deployments.replicas.model_options import ModelOptions
from dsbd_core.algorithm.drivers.session_batch import Job, SessionBatcher
from dsbd_core.algorithm.policy.cost_model import ForwardCosts
from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT, describe_lookup
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models import load_causal_lm, stop_token_ids
from dsbd_core.models.calibrate import model_costs, pass_rate_inputs
from dsbd_core.models.decode_path import make_scorer, resolve_decode_path
from dsbd_core.models.draft_variants import head_support
from dsbd_core.models.dtypes import dtype_name, resolve_dtype
from dsbd_core.models.lookup_calibration import LOOKUP_COSTS, LOOKUP_SUPPORT
from dsbd_core.models.pair import model_identity, prepare_draft
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.tensor_parallel import model_config

_ACTIVE_S = 1.0  # a session with a call this recent is expected to call again soon


class SessionReleased(RuntimeError):
    """A call for a session this replica has released: its request is over."""


class ModelReplica:
    """Base of `Draft` and `Verifier`."""

    SERVICE = "dsbd-model"  # the tracing service name (dsbd-draft, dsbd-verifier)
    SPAN = "dsbd.model"  # the name of the span of each call (dsbd.draft, dsbd.verify)
    CHEAP_VARIANT = False  # the Draft applies `ModelOptions.variant` (int8, restricted head)

    def __init__(
        self, options: dict[str, Any] | ModelOptions, target_source: str | None = None
    ) -> None:
        """`target_source`: the target's, where this replica hosts the prompt-lookup draft
        (`source: ngram`): its vocabulary size is the target's."""
        self.options = ModelOptions.model_validate(options)
        torch.set_num_threads(self.options.threads)
        torch_dtype, self.dtype_reason = resolve_dtype(self.options.dtype, self.options.device)
        self.dtype_name = dtype_name(torch_dtype)
        self.tp_group: Any = None
        self.costs: ForwardCosts | None = None  # measured forward costs (the cost model's)
        # what the costs were measured for, and the pair's pass-rate prompts in this model's
        # tokens with its stop ids (the router measures the pair's pass rates with them)
        self.identity: dict[str, Any] | None = None
        self.pass_rate_inputs: dict[str, Any] | None = None
        self.variant, self.support_size = "", None
        self.decode_path = "dynamic"  # a tensor-parallel group runs the dynamic path
        memory: dict[str, Any] | None = None
        if self.options.source == LOOKUP_DRAFT:
            self._host_lookup(target_source)
        elif self.options.tp_size > 1:
            from deployments.replicas.tp_group import TensorParallelScorer

            self.tp_group = TensorParallelScorer(
                self.options.source,
                tp_size=self.options.tp_size,
                dtype=self.dtype_name,
                device=self.options.device,
                threads=self.options.threads,
                placement_strategy=self.options.tp_placement,
                init_timeout_s=self.options.tp_init_timeout_s,
            )
            self.scorer: Any = self.tp_group
            self.vocab_size = self.tp_group.vocab_size
            self.max_positions = self.tp_group.max_positions
            kv = kv_bytes_per_token(
                model_config(self.options.source), torch_dtype, self.options.tp_size
            )
            free = min(info.get("free_bytes", 0) for info in self.tp_group.rank_infos)
        else:
            loaded = load_causal_lm(self.options.source, dtype=torch_dtype)
            loaded.model.to(self.options.device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
            if self.CHEAP_VARIANT:
                self.variant = prepare_draft(loaded, self.options.variant, stop_token_ids(loaded))
                support = head_support(loaded.model)
                self.support_size = support.numel() if support is not None else None
            model = loaded.model
            self.vocab_size = loaded.vocab_size
            self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
            self.decode_path = resolve_decode_path(self.options.decode_path, self.options.device)
            self.scorer = make_scorer(
                model, self.decode_path, batch_invariant=self.options.batch_invariant
            )
            if isinstance(self.scorer, StaticScorer) and self.options.device == "cuda":
                status = self.scorer.capture(
                    rows=self.options.max_batch_size, length=min(self.max_positions, 2048)
                )  # grows on demand
                print(
                    f"{type(self).__name__} static path: buckets rows {status['row_buckets']} "
                    f"x slots {status['slot_buckets']} captured in {status['capture_s']:.1f} s, "
                    f"graphs {status['graph_memory_mib']} MiB, KV pool {status['pool_mib']} MiB",
                    flush=True,
                )
            identity = {
                "model": model_identity(loaded),
                "dtype": self.dtype_name,
                "device": self.options.device,
                "variant": self.variant,
            }
            self.costs = model_costs(model, identity, path=self.decode_path)
            self.identity = {**identity, "decode_path": self.decode_path}
            self.pass_rate_inputs = pass_rate_inputs(loaded)
            kv = kv_bytes_per_token(model.config, torch_dtype)
            free = device_free_bytes(self.options.device)
        if self.options.source != LOOKUP_DRAFT:  # the look-up keeps no KV cache to admit
            memory = replica_memory(
                kv, self.options.session_memory_bytes, self.options.session_memory_fraction, free
            )
        self.memory = memory
        self.batcher = SessionBatcher(
            self.scorer, ttl_s=self.options.session_ttl_s, max_sessions=self.options.max_sessions
        )
        self.replica_id = replica_id()
        self._batches = 0  # batches run so far (the batch id of the spans)
        self.calls_run = 0  # calls answered (run in a batch) since the replica started
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task | None = None
        self._recent: dict[str, float] = {}  # session -> last call time (batch-wait policy)
        self._released: dict[str, float] = {}  # session -> when released (see `release`)
        self._batcher: ContinuousBatcher | None = None

    def _host_lookup(self, target_source: str | None) -> None:
        """The prompt-lookup draft instead of a model (issue 48): no weights, no KV cache, no
        forward to price (`LOOKUP_COSTS`); the router calibrates the pair through it as it
        does a model draft's (its pass rates and iteration seconds, cached per machine)."""
        if target_source is None:
            raise ValueError(f"source={LOOKUP_DRAFT!r}: the draft needs the target's source")
        config = model_config(target_source).get_text_config(decoder=True)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = 1 << 20
        ngram_max = self.options.variant.ngram_max
        self.scorer = NgramDraft(self.vocab_size, ngram_max)
        self.variant = describe_lookup(ngram_max)
        self.support_size = min(LOOKUP_SUPPORT, self.vocab_size)
        self.costs = LOOKUP_COSTS
        self.identity = {"model": f"{LOOKUP_DRAFT}-{ngram_max}", "variant": self.variant}

    def idle(self) -> bool:
        """No call queued and no batch running: a late call of an ended request (a retried
        iteration's first attempt, say) may still run after its request has returned."""
        return not self._lock.locked() and (self._batcher is None or self._batcher.idle)

    async def run_jobs(self, jobs: list[Job]) -> tuple[list[Any], SideReport]:
        """Run one batch (one at a time) in a worker thread; returns values and the report."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        async with self._lock:
            self.calls_run += len(jobs)
            fault_point(type(self).__name__.lower(), calls=len(jobs))  # off unless tests ask
            start = time.perf_counter()
            results, report = await asyncio.to_thread(self.batcher.run, jobs)
            seconds = time.perf_counter() - start
            for job in jobs:  # a late call of a request that ended meanwhile: keep no cache
                if job.key in self._released:
                    self.batcher.release(job.key)
        return results, SideReport(report, self.replica_id, seconds)

    def trace_batch(self, calls: list[tuple[str, IterationCall]]) -> BatchSpans:
        """The spans of one batch's calls (deployments/observability/tracing.py); nothing
        unless tracing."""
        self._batches += 1
        batch = {
            "dsbd.replica": self.replica_id,
            "dsbd.batch.requests": len(calls),
            "dsbd.batch.id": f"{self.replica_id}:{self._batches}",
        }
        return BatchSpans(self.SERVICE, self.SPAN, calls, batch)

    async def submit(self, session: str, item: Any) -> Any:
        """Queue one call for the next batch (continuous batching); raises its error if any."""
        if session in self._released:
            raise SessionReleased(
                f"session {session!r} was released: a late call of a request that has ended"
            )
        now = time.monotonic()
        self._recent[session] = now
        if len(self._recent) > 4 * self.options.max_batch_size:
            self._recent = {k: t for k, t in self._recent.items() if now - t < _ACTIVE_S}
        if self._batcher is None:
            self._batcher = ContinuousBatcher(
                self.run_batch,
                max_batch_size=self.options.max_batch_size,
                wait_s=self.options.batch_wait_s,
                expected=self._active_sessions,
            )
        return await self._batcher.submit((session, item))

    async def run_batch(self, items: list[tuple[str, Any]]) -> list[Any]:
        """One batch of (session, call) items -> one value or exception per item."""
        raise NotImplementedError

    def _active_sessions(self) -> int:
        now = time.monotonic()
        return sum(1 for t in self._recent.values() if now - t < _ACTIVE_S)

    async def release(self, session: str) -> bool:
        """Free a session's cache (request done, failed or cancelled), for good.

        The id is remembered (for `session_ttl_s`): a call of the session that is still on its
        way or queued here (the draft call of a cancelled request, which the router never
        awaits) would otherwise re-create the cache after this release, to be held until the
        TTL. Found under load with clients that go away (docs/history/RELIABILITY-chronicle.md).
        """
        self._released[session] = time.monotonic()
        self._recent.pop(session, None)
        async with self._lock:
            return self.batcher.release(session)

    async def info(self) -> dict[str, Any]:
        """What the router needs to know about this model, and what this replica holds."""
        info = {
            "vocab_size": self.vocab_size,
            "max_positions": self.max_positions,
            "replica": self.replica_id,
            "pid": os.getpid(),
            "cached_sessions": self.batcher.cached,
            "calls_run": self.calls_run,
            "tp_size": self.options.tp_size,
            "dtype": self.dtype_name,
            "dtype_reason": self.dtype_reason,
            "variant": self.variant,
            "support_size": self.support_size,
            "costs": self.costs.model_dump() if self.costs is not None else None,
            "identity": self.identity,
            "pass_rate_inputs": self.pass_rate_inputs,
            "memory": self.memory,  # KV bytes per token and the session budget (admission)
            "allocator": active_allocator(),  # jemalloc unless asked otherwise (allocator.py)
            "allocator_stats": allocator_stats(),  # live vs held bytes (`dsbd bench soak`)
            "primitive_cache": primitive_cache_capacity(),  # both caches', from the environment
            "decode_path": self.scorer.status()
            if isinstance(self.scorer, StaticScorer)
            else {"path": self.decode_path},  # the static path's ladder, graphs and pool
        }
        if self.tp_group is not None:
            info["tp_ranks"] = {"pids": self.tp_group.pids, "device": self.tp_group.info["device"]}
        return info

    async def check_health(self) -> None:
        """Serve's periodic health check: a lost tensor-parallel rank fails the replica."""
        if self.tp_group is not None:
            await asyncio.to_thread(self.tp_group.check)

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: the ranks go with it."""
        group = getattr(self, "tp_group", None)
        if group is not None:
            group.shutdown()

    async def _sweep_forever(self) -> None:
        """Free caches past their TTL even when no call comes (an idle replica)."""
        period = min(30.0, self.options.session_ttl_s / 2)
        while True:
            await asyncio.sleep(period)
            async with self._lock:
                self.batcher.expire()
            limit = time.monotonic() - self.options.session_ttl_s
            self._released = {k: t for k, t in self._released.items() if t >= limit}
