"""A replica's tensor-parallel group: `tp_size` Ray actors, one shard of the model each.

The replica owns the group. Under Ray Serve the replica's placement group (Serve creates it from
`placement_group_bundles`, see deployments/app.py) has the replica's own bundle first and then
one bundle per rank (one GPU each on GPU clusters), `STRICT_PACK` by default so the ranks share
a node and talk over its fastest links; outside Serve (tests, scripts) the group creates and
removes its own placement group. Ranks join a `torch.distributed` group (NCCL on GPU, gloo on
CPU) through a store on rank 0's node (a file when all ranks share the node, see `init_group`).

`TensorParallelScorer` is the replica's scorer (what `SessionBatcher` drives): every call goes
to all ranks in the same order (each actor runs its calls one at a time, in submission order),
each rank runs it SPMD on its shard (`dsbd_core.tensor_parallel.ShardedScorer`), and rank 0's
result comes back. Session caches never leave the ranks; the batcher stores `SessionHandle`s.

Failure: a rank that dies or errs leaves the others blocked in a collective (or out of step),
so ANY failure breaks the whole group: every rank is killed at once, the calls in flight and
every later call raise `TensorParallelBroken` (their requests fail fast instead of hanging),
and `check` raises, which fails the replica's Serve health check so that Serve replaces the
replica with a fresh group.
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
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsbd_core.tensor_parallel import (
    ShardedScorer,
    check_split,
    init_group,
    load_sharded,
    model_config,
)

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class TensorParallelBroken(RuntimeError):
    """The group lost a rank (or a rank failed); the replica must be replaced."""


def worker_bundle(threads: int, device: str) -> dict[str, float]:
    """The resources of one rank: its CPU threads, and one GPU when it runs on CUDA."""
    bundle: dict[str, float] = {"CPU": float(threads)}
    if device == "cuda":
        bundle["GPU"] = 1.0
    return bundle


@ray.remote(max_restarts=0, concurrency_groups={"health": 1})
class TPWorker:
    """One rank: its shard of the model and its shards of every session's KV cache."""

    def __init__(self, rank: int, world_size: int, threads: int, device: str) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.scorer: ShardedScorer | None = None
        self.info: dict[str, Any] = {}

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

    def setup(self, store: str, source: str, dtype: str) -> dict[str, Any]:
        """Join the group and load this rank's shard; returns what the replica needs."""
        self.scorer, self.info = _join_and_load(
            self.rank, self.world_size, store, source, dtype, self.device,
            getattr(self, "_store_dir", None),
        )  # fmt: skip
        return self.info

    def call(self, method: str, *args: Any) -> Any:
        """Run one scorer method on this rank (all ranks get the same calls, in order)."""
        assert self.scorer is not None, "setup first"
        result = getattr(self.scorer, method)(*args)
        return result if self.rank == 0 else None

    def stored(self) -> int:
        """Session caches kept on this rank."""
        return self.scorer.stored if self.scorer is not None else 0

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """Answered even while a forward runs (its own concurrency group)."""
        return self.rank


def _join_and_load(
    rank: int, world_size: int, store: str, source: str, dtype: str, device: str,
    store_dir: str | None,
) -> tuple[ShardedScorer, dict[str, Any]]:  # fmt: skip
    """A rank's setup. Module-level on purpose: Ray pickles actor methods by value, with their
    globals, and some torch modules do not pickle; a module function goes by reference."""
    cuda = device == "cuda"
    if cuda:  # Ray made exactly one GPU visible to this actor
        torch.cuda.set_device(0)
    init_group(rank, world_size, store, backend="nccl" if cuda else "gloo",
               local_rank=0 if cuda else None)  # fmt: skip
    model = load_sharded(source, dtype=DTYPES[dtype])
    dist.barrier()  # every rank has loaded (and made its subgroups): the store is done with
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)
    scorer = ShardedScorer(model)
    config = model.config.get_text_config(decoder=True)
    return scorer, {
        "vocab_size": scorer.vocab_size,
        "max_positions": int(getattr(config, "max_position_embeddings", 0) or 1 << 20),
        "pid": os.getpid(),
        "device": str(next(model.parameters()).device),
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
        setup_timeout_s: float = 600.0,
        call_timeout_s: float = 600.0,
    ) -> None:
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
            if not group.wait(timeout_seconds=setup_timeout_s):
                self.shutdown()
                raise TensorParallelBroken(
                    f"the {tp_size} ranks' resources ({bundle} each, {placement_strategy}) "
                    f"were not available within {setup_timeout_s:.0f} s"
                )
        else:  # the replica's own bundle first, then one per rank
            first = len(group.bundle_specs) - tp_size
            if first < 0:
                raise TensorParallelBroken(
                    f"the replica's placement group has {len(group.bundle_specs)} bundles; "
                    f"tp_size={tp_size} needs one per rank after the replica's own"
                )
        self.workers = [
            TPWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=first + rank
                ),
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
            ).remote(rank, tp_size, threads, device)
            for rank in range(tp_size)
        ]
        try:
            nodes = self._all([w.node.remote() for w in self.workers], setup_timeout_s, "node")
            store = ray.get(self.workers[0].rendezvous.remote(len(set(nodes)) == 1),
                            timeout=setup_timeout_s)  # fmt: skip
            infos = self._all([w.setup.remote(store, source, dtype) for w in self.workers],
                              setup_timeout_s, "setup")  # fmt: skip
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]
        self.pids = [info["pid"] for info in infos]
        self.vocab_size: int = self.info["vocab_size"]
        self.max_positions: int = self.info["max_positions"]

    # ------------------------------------------------------------------ SessionScorer API

    def set_roots(self, tokens: Any, lengths: Any, alive: Any, origin: Any) -> None:
        self._call("set_roots", tokens, lengths, alive, origin)

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
            return self._all([w.stored.remote() for w in self.workers], self.call_timeout_s,
                             "stored")  # fmt: skip

    def shutdown(self) -> None:
        """Kill every rank and free the placement group this scorer made (idempotent)."""
        for worker in getattr(self, "workers", []):
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
                    self._break(f"rank {rank} failed in {what!r}: {type(error).__name__}: "
                                f"{str(error).splitlines()[0] if str(error) else ''}")  # fmt: skip
        return [results[ref] for ref in refs]

    def _break(self, why: str) -> None:
        self._broken = f"tensor-parallel group broken: {why}"
        self.shutdown()
        raise TensorParallelBroken(self._broken)
