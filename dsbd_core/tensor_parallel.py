"""Tensor parallelism for the target: one model sharded Megatron-style over a process group.

Sharding is transformers' own (`from_pretrained(..., distributed_config=DistributedConfig(
tp_size=N))`, DTensor parameters): the model's `base_model_tp_plan` makes q/k/v and gate/up
column-parallel and o/down row-parallel with an all-reduce, and the head column-parallel with
its output gathered, so every rank ends a forward with the full logits. Its inference path runs
each rank's local shard with plain tensors, which is what keeps the forest forward unchanged:
the 4-D tree mask broadcasts over whatever heads a rank holds, and the KV cache of a rank is a
plain `DynamicCache` of its own KV heads, which `TransformerScorer` compacts and stacks exactly as
on one device. Nothing here knows about Ray: a `ShardedScorer` runs on every rank of an
initialised `torch.distributed` group and must be given the same calls in the same order on all
of them (SPMD); only rank 0 returns what it computed.

transformers accepts uneven shards (the last rank holds a shorter slice), but attention cannot
split a head, and an uneven MLP split would leave ranks idle; `check_split` refuses both at load,
naming the field.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from dsbd_core.models import ModelSourceError, _hub_offline, resolve_source
from dsbd_core.scorer import ForestLayer, ForestLogprobs, Origin
from dsbd_core.transformer_scorer import SessionCache, TransformerScorer

SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


class TensorParallelError(ValueError):
    """A model or group that cannot be sharded as asked (the message names the field)."""


@dataclass(frozen=True)
class SessionHandle:
    """Names one session cache row that every rank keeps its own shard of (see `ShardedScorer`).

    A serving replica stores handles where a one-device replica stores the caches themselves;
    the tensors never leave the ranks.
    """

    id: int


def check_split(config: PretrainedConfig, tp_size: int) -> None:
    """Refuse a `tp_size` that does not split the model's heads and MLP evenly."""
    if tp_size < 1:
        raise TensorParallelError(f"tp_size must be >= 1, got {tp_size}")
    text = config.get_text_config(decoder=True)
    if tp_size == 1:
        return
    plan = getattr(text, "base_model_tp_plan", None)
    if not plan:
        raise TensorParallelError(
            f"model type {text.model_type!r} has no tensor-parallel plan in transformers; "
            "tp_size must be 1 for it (Llama, Qwen2 and most decoder-only models have one)"
        )
    for name in SPLIT_FIELDS:
        value = getattr(text, name, None)
        if name == "num_key_value_heads" and value is None:
            value = text.num_attention_heads
        if value is None:
            continue
        if value % tp_size:
            allowed = [d for d in range(1, value + 1) if value % d == 0]
            raise TensorParallelError(
                f"tp_size={tp_size} does not split {text.model_type} {name}={value} evenly; "
                f"tp_size must divide {name}: one of {allowed} for this model"
            )


def model_config(source: str | Path) -> PretrainedConfig:
    """The config of a model source (preset, directory, .gguf or hub id) without its weights."""
    resolved = resolve_source(str(source))
    try:
        return AutoConfig.from_pretrained(resolved, local_files_only=_hub_offline())
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot read the config of {str(source)!r}: {error}") from error


def init_group(
    rank: int,
    world_size: int,
    store: str,
    *,
    backend: str,
    local_rank: int | None = None,
    timeout_s: float = 120.0,
) -> None:
    """Join the group (gloo on CPU, NCCL on GPU) through `store`.

    `store` is `file:///path` when every rank runs on one node (the default placement), else
    `tcp://host:port` on rank 0's node. A file store is preferred because torch's TCP store
    reverse-resolves peer addresses for its logs: a DNS query to the resolver even on loopback
    (seen in tests/test_serving.py's syscall trace). Colocated ranks are told to keep gloo and
    NCCL on the loopback interface: left alone they bind the address the hostname resolves to.
    `local_rank` is the GPU index this process uses (0 where it sees only its own GPU, as a Ray
    actor does).
    """
    local_rank = rank if local_rank is None else local_rank
    if store.startswith("file://") or store.startswith(("tcp://127.", "tcp://localhost")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    dist.init_process_group(
        backend,
        init_method=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=torch.device("cuda", local_rank) if backend == "nccl" else None,
    )


def load_sharded(source: str | Path, *, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """This rank's shard of the model (call on every rank of an initialised group, same args)."""
    from transformers.distributed import DistributedConfig

    tp_size = dist.get_world_size() if dist.is_initialized() else 1
    config = model_config(source)
    check_split(config, tp_size)
    resolved = resolve_source(str(source))
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if tp_size > 1:
        kwargs["distributed_config"] = DistributedConfig(tp_size=tp_size)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            resolved, local_files_only=_hub_offline(), **kwargs
        )
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot load a causal LM from {str(source)!r}: {error}") from error
    if tp_size == 1 and device != "cpu":
        model = model.to(device)
    return model.eval()


class ShardedScorer:
    """A `TransformerScorer` over this rank's shard, with session caches kept on the rank.

    Every method must be called on all ranks with the same arguments (the forward runs
    collectives). `export_sessions` keeps the caches here under fresh handles and returns the
    handles; `import_sessions` takes them back; `discard_sessions` frees handles the caller
    dropped. Identical call sequences keep the ranks' stores identical, which the collectives
    need (a rank re-prefilling alone would deadlock the group). Rank 0 returns outputs; the
    other ranks return None so that nothing is copied twice.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.scorer = TransformerScorer(model)  # type: ignore[arg-type]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._store: dict[int, SessionCache | None] = {}
        self._ids = itertools.count()

    @property
    def vocab_size(self) -> int:
        return self.scorer.vocab_size

    @property
    def forward_calls(self) -> int:
        return self.scorer.forward_calls

    def set_roots(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        alive: torch.Tensor,
        origin: Origin | None,
    ) -> None:
        self.scorer.set_roots(tokens, lengths, alive, origin)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs | None:
        out = self.scorer.forward(layers)
        return out if self.rank == 0 else None

    def export_sessions(self) -> list[SessionHandle | None]:
        handles: list[SessionHandle | None] = []
        for session in self.scorer.export_sessions():
            if session is None:
                handles.append(None)
                continue
            handle = SessionHandle(next(self._ids))
            self._store[handle.id] = session
            handles.append(handle)
        return handles

    def import_sessions(self, handles: Sequence[SessionHandle | None]) -> None:
        self.scorer.import_sessions(
            [self._store.pop(h.id, None) if h is not None else None for h in handles]
        )

    def discard_sessions(self, handles: Sequence[SessionHandle | None]) -> None:
        for handle in handles:
            if handle is not None:
                self._store.pop(handle.id, None)

    def release(self) -> None:
        self.scorer.release()
        self._store.clear()

    @property
    def stored(self) -> int:
        """Session caches kept on this rank (leak checks)."""
        return len(self._store)
