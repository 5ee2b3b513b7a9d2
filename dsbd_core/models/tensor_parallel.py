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

The device is the caller's choice, not transformers': left alone, transformers puts the mesh on
the accelerator torch was built for, cuda on any CUDA build whether or not this rank may use a
GPU (see `_mesh_on`). `init_group` and `load_sharded` take the rank's device and make it hold.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.errors import ModelSourceError
from dsbd_core.models.loading import hub_offline, resolve_source
from dsbd_core.models.options import INIT_TIMEOUT_S
from dsbd_core.models.transformer_scorer import SessionCache, TransformerScorer

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
    """Refuse a `tp_size` that does not split the model's heads and MLP evenly.

    The sizes offered are those that divide every split field at once (the divisors of their
    gcd): a divisor of the heads alone may still fail on the KV heads or the MLP width.
    """
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
    sizes = split_sizes(text)
    common = math.gcd(*sizes.values())
    allowed = [d for d in range(1, common + 1) if common % d == 0]
    for name, value in sizes.items():
        if value % tp_size:
            fields = ", ".join(f"{n}={v}" for n, v in sizes.items())
            raise TensorParallelError(
                f"tp_size={tp_size} does not split {text.model_type} {name}={value} evenly; "
                f"tp_size must divide all of {fields}: one of {allowed} for this model"
            )


def split_sizes(text: PretrainedConfig) -> dict[str, int]:
    """The sizes tensor parallelism splits (KV heads default to the heads, as in transformers)."""
    sizes: dict[str, int] = {}
    for name in SPLIT_FIELDS:
        value = getattr(text, name, None)
        if name == "num_key_value_heads" and value is None:
            value = text.num_attention_heads
        if value is not None:
            sizes[name] = int(value)
    return sizes


def model_config(source: str | Path) -> PretrainedConfig:
    """The config of a model source (preset, directory, .gguf or hub id) without its weights."""
    resolved = resolve_source(str(source))
    try:
        return AutoConfig.from_pretrained(resolved, local_files_only=hub_offline())
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot read the config of {str(source)!r}: {error}") from error


def rank_device(device: str | torch.device) -> torch.device:
    """`device` checked: cpu, or one GPU (`cuda` alone means cuda:0, the only GPU a Ray rank
    actor sees)."""
    parsed = torch.device(device)
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "cuda":
        return torch.device("cuda", parsed.index or 0)
    raise TensorParallelError(f"device={str(device)!r}: a rank runs on 'cpu' or 'cuda[:N]'")


def init_group(
    rank: int,
    world_size: int,
    store: str,
    *,
    device: str | torch.device = "cpu",
    timeout_s: float = INIT_TIMEOUT_S,
) -> None:
    """Join the group through `store`: gloo when `device` is cpu, NCCL bound to the GPU when it
    is cuda:N. `timeout_s` bounds every collective of the group (see `INIT_TIMEOUT_S`).

    `store` is `file:///path` when every rank runs on one node (the default placement), else
    `tcp://host:port` on rank 0's node. A file store is preferred because torch's TCP store
    reverse-resolves peer addresses for its logs: a DNS query to the resolver even on loopback (seen
    in tests/serving/test_serving.py's syscall trace). Colocated ranks are told to keep gloo and
    NCCL on the loopback interface: left alone they bind the address the hostname resolves to.
    """
    if not timeout_s > 0:
        raise TensorParallelError(f"timeout_s={timeout_s}: must be > 0 seconds")
    device = rank_device(device)
    if store.startswith("file://") or store.startswith(("tcp://127.", "tcp://localhost")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if cuda else None,
    )


def load_sharded(
    source: str | Path, *, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """This rank's shard of the model on `device` (call on every rank of an initialised group,
    same args; `device` is the one the group was initialised with)."""
    from transformers.distributed import DistributedConfig

    tp_size = dist.get_world_size() if dist.is_initialized() else 1
    config = model_config(source)
    check_split(config, tp_size)
    resolved = resolve_source(str(source))
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if tp_size == 1:
        model = _from_pretrained(source, resolved, kwargs)
        return (model if str(device) == "cpu" else model.to(device)).eval()
    device = rank_device(device)
    backend = dist.get_backend()
    if backend != ("nccl" if device.type == "cuda" else "gloo"):
        raise TensorParallelError(
            f"device={device} in a {backend} group: cpu ranks use gloo, cuda ranks NCCL "
            "(initialise the group with the same device, see init_group)"
        )
    kwargs["distributed_config"] = DistributedConfig(tp_size=tp_size)
    with _mesh_on(device):
        model = _from_pretrained(source, resolved, kwargs)
    if wrong := [d for d in shard_devices(model) if torch.device(d) != device]:
        raise TensorParallelError(f"the shard was placed on {wrong}, not on device={device}")
    return model.eval()


def shard_devices(model: torch.nn.Module) -> list[str]:
    """The devices of this rank's parameters and buffers (local shards of DTensors)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sorted({str((t.to_local() if isinstance(t, DTensor) else t).device) for t in tensors})


@contextmanager
def _mesh_on(device: torch.device) -> Iterator[None]:
    """While it lasts, transformers builds its device mesh on `device`.

    transformers (`distributed.utils.initialize_distributed_mesh`; before 5.15
    `integrations.tensor_parallel.initialize_tensor_parallelism`) takes the mesh's device type
    from `torch._C._get_accelerator()` and binds `<type>:LOCAL_RANK`. That is the
    accelerator torch was BUILT for: a CUDA build says cuda even where CUDA_VISIBLE_DEVICES
    hides every GPU, and then binds a GPU (or fails); LOCAL_RANK is whatever the launcher set
    (torchrun: the rank on the node, not the GPU Ray gave an actor). No argument overrides
    either (`device_mesh` is replaced by its own, `device_map` is refused with TP), so both are
    set for the load: the accelerator reads `device`'s type, LOCAL_RANK its index (on cpu it is
    not read). Process-wide while it lasts; a rank process loads one model and runs nothing
    else meanwhile.
    """
    original = torch._C._get_accelerator
    torch._C._get_accelerator = lambda check=False: torch.device(device.type)
    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)
    try:
        yield
    finally:
        torch._C._get_accelerator = original


def _from_pretrained(source: str | Path, resolved: str | Path, kwargs: dict[str, Any]) -> Any:
    try:
        return AutoModelForCausalLM.from_pretrained(
            resolved, local_files_only=hub_offline(), **kwargs
        )
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot load a causal LM from {str(source)!r}: {error}") from error


class ShardedScorer:
    """A `TransformerScorer` over this rank's shard, with session caches kept on the rank.

    Every method must be called on all ranks with the same arguments (the forward runs
    collectives). `export_sessions` keeps the caches here under fresh handles and returns the
    handles; `import_sessions` takes them back; `discard_sessions` frees handles the caller
    dropped. Identical call sequences keep the ranks' stores identical, which the collectives
    need (a rank re-prefilling alone would deadlock the group). Rank 0 returns outputs; the
    other ranks return None so that nothing is copied twice.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.scorer = TransformerScorer(model)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._store: dict[int, SessionCache | None] = {}
        self._ids = itertools.count()

    @property
    def vocab_size(self) -> int:
        return self.scorer.vocab_size

    @property
    def forward_calls(self) -> int:
        return self.scorer.forward_calls

    def set_roots(self, roots: Roots) -> None:
        self.scorer.set_roots(roots)

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
