"""A replica's tensor-parallel group: `tp_size` Ray actors, one shard of the model each.

The replica owns the group. Under Ray Serve the replica's placement group (Serve creates it from
`placement_group_bundles`, see deployments/app.py) has the replica's own bundle first and then
one bundle per rank (one GPU each on GPU clusters), `STRICT_PACK` by default so the ranks share
a node and talk over its fastest links; outside Serve (tests, scripts) the group creates and
removes its own placement group. Ranks join a `torch.distributed` group (NCCL on GPU, gloo on
CPU) through a store on rank 0's node (a file when all ranks share the node, see `init_group`),
kept until the group shuts down (NCCL sets up some communicators on first use, through it).

The device is the one asked for, never one a library picks (`actor_device`): a cpu rank sees no
GPU at all, a cuda rank uses exactly the GPU Ray reserved for it.

`TensorParallelScorer` is the replica's scorer (what `SessionBatcher` drives): every call goes
to all ranks in the same order (each actor runs its calls one at a time, in submission order),
each rank runs it SPMD on its shard (`dsbd_core.models.tensor_parallel.ShardedScorer`), and rank 0's
result comes back. Session caches never leave the ranks; the batcher stores `SessionHandle`s.

Failure: a rank that dies or errs leaves the others blocked in a collective (or out of step),
so ANY failure breaks the whole group: every rank is killed at once, the calls in flight and
every later call raise `TensorParallelBroken` at once instead of hanging (the router retries
those iterations on another replica), and `check` raises, which fails the replica's Serve
health check so that Serve replaces the replica with a fresh group.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.faults import fault_point
from deployments.messages import TensorParallelBroken
from deployments.replicas.memory import device_free_bytes
from deployments.replicas.model_options import worker_bundle
from dsbd_core.models.options import INIT_TIMEOUT_S
from dsbd_core.models.tensor_parallel import (
    ShardedScorer,
    check_split,
    init_group,
    load_sharded,
    model_config,
    shard_devices,
)

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def actor_device(device: str, gpu_ids: list[Any], visible: str | None) -> str:
    """The torch device of a rank actor, from what Ray gave it.

    cpu: "cpu" (the actor hides every GPU, see `TPWorker`). cuda: the rank's bundle asks for
    one GPU, so Ray reserved one (`gpu_ids`, from `ray.get_gpu_ids()`) and made it the only
    visible one (`visible`, CUDA_VISIBLE_DEVICES), so it is cuda:0 in the actor. Anything else
    (Ray told not to set the variable, a fractional GPU) is refused rather than guessed.
    """
    if device == "cpu":
        return "cpu"
    if len(gpu_ids) != 1 or (visible or "").split(",") != [str(g) for g in gpu_ids]:
        raise TensorParallelBroken(
            f"a cuda rank needs the one GPU Ray reserved for it as its only visible GPU; got "
            f"ray.get_gpu_ids()={gpu_ids}, CUDA_VISIBLE_DEVICES={visible!r}"
        )
    return "cuda:0"


@ray.remote(max_restarts=0, concurrency_groups={"health": 1})  # type: ignore[call-overload]  # Ray's overloads lack concurrency_groups
class TPWorker:
    """One rank: its shard of the model and its shards of every session's KV cache."""

    def __init__(self, rank: int, world_size: int, threads: int, device: str) -> None:
        torch.set_num_threads(threads)
        if device == "cpu":  # Ray (2.60) no longer hides GPUs from actors with num_gpus=0
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything here initialises CUDA
        self.rank, self.world_size, self.device = rank, world_size, device
        self.scorer: ShardedScorer | None = None
        self.info: dict[str, Any] = {}
        self._store_dir: str | None = None

    def node(self) -> str:
        """The Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self, colocated: bool) -> str:
        """The store every rank joins through (rank 0 only): a file on this node when all ranks
        share it, else a TCP port on this node's address."""
        if colocated:
            self._store_dir = tempfile.mkdtemp(prefix="dsbd-tp-")
            return f"file://{self._store_dir}/store"
        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((address, 0))
            return f"tcp://{address}:{sock.getsockname()[1]}"

    def setup(self, store: str, source: str, dtype: str, timeout_s: float) -> dict[str, Any]:
        """Join the group and load this rank's shard; returns what the replica needs."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = actor_device(self.device, ray.get_gpu_ids(), visible)
        self.scorer, self.info = _join_and_load(
            self.rank, self.world_size, store, source, dtype, device, timeout_s
        )
        return self.info

    def call(self, method: str, *args: Any) -> Any:
        """Run one scorer method on this rank (all ranks get the same calls, in order)."""
        assert self.scorer is not None, "setup first"
        fault_point(f"tp-rank{self.rank}", method)  # off unless tests ask (deployments/faults)
        result = getattr(self.scorer, method)(*args)
        return result if self.rank == 0 else None

    def stored(self) -> int:
        """Session caches kept on this rank."""
        return self.scorer.stored if self.scorer is not None else 0

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """Answered even while a forward runs (its own concurrency group)."""
        return self.rank

    @ray.method(concurrency_group="health")
    def remove_store(self) -> None:
        """Delete the rendezvous file (rank 0, at shutdown; answered even mid-forward)."""
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)


def _join_and_load(
    rank: int,
    world_size: int,
    store: str,
    source: str,
    dtype: str,
    device: str,
    timeout_s: float,
) -> tuple[ShardedScorer, dict[str, Any]]:
    """A rank's setup. Module-level on purpose: Ray pickles actor methods by value, with their
    globals, and some torch modules do not pickle; a module function goes by reference."""
    init_group(rank, world_size, store, device=device, timeout_s=timeout_s)
    model = load_sharded(source, dtype=DTYPES[dtype], device=device)
    dist.barrier()  # every rank has loaded: the replica may start calling
    scorer = ShardedScorer(model)
    config = model.config.get_text_config(decoder=True)
    return scorer, {
        "vocab_size": scorer.vocab_size,
        "max_positions": int(getattr(config, "max_position_embeddings", 0) or 1 << 20),
        "pid": os.getpid(),
        "device": device,
        "shard_devices": shard_devices(model),
        "cuda_initialized": torch.cuda.is_initialized(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "group_timeout_s": timeout_s,
        "free_bytes": device_free_bytes(device),  # the session budget's default (admission)
    }


class TensorParallelScorer:
    """The `SessionScorer` of a replica whose model spans `tp_size` ranks (see module doc)."""

    def __init__(
        self,
        source: str,
        *,
        tp_size: int,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int = 1,
        placement_strategy: str = "STRICT_PACK",
        init_timeout_s: float = INIT_TIMEOUT_S,
        call_timeout_s: float = 600.0,
    ) -> None:
        """`init_timeout_s` bounds forming the group (the ranks' resources, loading, the first
        barrier) and is the timeout of the group's collectives; `call_timeout_s` bounds each
        call, after which the group is broken."""
        if not init_timeout_s > 0:
            raise ValueError(f"init_timeout_s={init_timeout_s}: must be > 0 seconds")
        check_split(model_config(source), tp_size)  # a clear error before any rank starts
        self.tp_size = tp_size
        self.call_timeout_s = call_timeout_s
        self.forward_calls = 0
        self._broken: str | None = None
        self._lock = threading.Lock()  # one call sequence at a time (SessionBatcher: one batch)
        bundle = worker_bundle(threads, device)
        group = get_current_placement_group()
        self._own_group: PlacementGroup | None = None
        if group is None:  # outside Serve: a placement group of our own
            group = placement_group([bundle] * tp_size, strategy=placement_strategy)
            self._own_group = group
            first = 0
            if not group.wait(timeout_seconds=init_timeout_s):
                self.shutdown()
                raise TensorParallelBroken(
                    f"the {tp_size} ranks' resources ({bundle} each, {placement_strategy}) "
                    f"were not available within {init_timeout_s:.0f} s"
                )
        else:  # the replica's own bundle first, then one per rank
            first = len(group.bundle_specs) - tp_size
            if first < 0:
                raise TensorParallelBroken(
                    f"the replica's placement group has {len(group.bundle_specs)} bundles; "
                    f"tp_size={tp_size} needs one per rank after the replica's own"
                )
        self.workers = [
            TPWorker.options(  # type: ignore[attr-defined]  # @ray.remote made it an ActorClass
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=first + rank
                ),
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
            ).remote(rank, tp_size, threads, device)
            for rank in range(tp_size)
        ]
        try:
            nodes = self._all([w.node.remote() for w in self.workers], init_timeout_s, "node")
            self.store = ray.get(
                self.workers[0].rendezvous.remote(len(set(nodes)) == 1), timeout=init_timeout_s
            )
            infos = self._all(
                [w.setup.remote(self.store, source, dtype, init_timeout_s) for w in self.workers],
                init_timeout_s,
                "setup",
            )
        except BaseException:
            self.shutdown()
            raise
        self.rank_infos = infos
        self.info = infos[0]
        self.pids = [info["pid"] for info in infos]
        self.vocab_size: int = self.info["vocab_size"]
        self.max_positions: int = self.info["max_positions"]

    # ------------------------------------------------------------------ SessionScorer API

    def set_roots(self, roots: Any) -> None:
        self._call("set_roots", roots)

    def forward(self, layers: Any) -> Any:
        out = self._call("forward", list(layers))
        self.forward_calls += 1
        return out

    def export_sessions(self) -> list[Any]:
        return self._call("export_sessions")

    def import_sessions(self, sessions: list[Any]) -> None:
        self._call("import_sessions", sessions)

    def discard_sessions(self, sessions: list[Any]) -> None:
        """Fire and forget: handles are never reused, so a late discard is harmless, and the
        caller (a release, the TTL sweep) must not wait on the ranks."""
        if self._broken is None:
            for worker in self.workers:
                worker.call.remote("discard_sessions", sessions)

    def release(self) -> None:
        if self._broken is None:
            self._call("release")

    # ------------------------------------------------------------------ health

    def check(self, timeout_s: float = 10.0) -> None:
        """Raise unless every rank is alive and answering (the Serve health check)."""
        if self._broken is not None:
            raise TensorParallelBroken(self._broken)
        self._all([w.ping.remote() for w in self.workers], timeout_s, "ping")

    def stored(self) -> list[int]:
        """Session caches kept on each rank (tests: nothing leaks)."""
        with self._lock:
            return self._all(
                [w.stored.remote() for w in self.workers], self.call_timeout_s, "stored"
            )

    def shutdown(self) -> None:
        """Remove the rendezvous file, kill every rank and free the placement group this scorer
        made (idempotent). The file goes only now: NCCL may need it until the group ends. A
        rank 0 that is already dead leaves it behind (a few bytes in its node's temp folder)."""
        workers = getattr(self, "workers", [])
        if workers:
            try:
                ray.get(workers[0].remove_store.remote(), timeout=5)
            except Exception:  # rank 0 is gone or stuck: nothing to wait for
                pass
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already gone
                pass
        if self._own_group is not None:
            try:
                remove_placement_group(self._own_group)
            except Exception:
                pass
            self._own_group = None

    # ------------------------------------------------------------------ internals

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._broken is not None:
                raise TensorParallelBroken(self._broken)
            if args and self.tp_size > 1:
                args = tuple(ray.put(a) for a in args)  # serialised once, read by every rank
            refs = [w.call.remote(method, *args) for w in self.workers]
            return self._all(refs, self.call_timeout_s, method)[0]

    def _all(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Every rank's result; the first failure or the timeout breaks the group at once."""
        results: dict[Any, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
            if not ready:
                self._break(f"rank(s) did not finish {what!r} within {timeout_s:.0f} s")
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as error:
                    rank = refs.index(ref)
                    # a RayTaskError's first line names only the method; its cause says why
                    cause = error.cause if isinstance(error, RayTaskError) else error
                    self._break(
                        f"rank {rank} failed in {what!r}: {type(error).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}"
                    )
        return [results[ref] for ref in refs]

    def _break(self, why: str) -> None:
        self._broken = f"tensor-parallel group broken: {why}"
        self.shutdown()
        raise TensorParallelBroken(self._broken)
