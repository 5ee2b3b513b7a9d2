"""How a model replica loads and runs its model (`ModelOptions`, a field of the application's
config) and what one tensor-parallel rank asks Ray for, with no torch or transformers import: the
application's builder validates a config with them without loading the replicas' code
(deployments/replicas/model_replica.py runs what they say)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.replicas.allocator import Allocator
from dsbd_core.models.options import INIT_TIMEOUT_S, DraftOptions


class ModelOptions(BaseModel):
    """How a model replica loads and runs its model."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        ...,
        description="Preset, transformers directory, .gguf file or hub id; the draft may also "
        "be 'ngram': the prompt-lookup draft (no weights; its bound: variant.ngram_max).",
    )
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|bfloat16|float64)$",
        description="auto: bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else float32.",
    )
    variant: DraftOptions = Field(
        DraftOptions(),
        description="Draft deployment only: int8 linear layers and a head restricted to the "
        "most frequent tokens (exact either way; dsbd_core.models.options.DraftOptions).",
    )
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads of the replica.")
    session_ttl_s: float = Field(300.0, gt=0, description="Free a session's cache after this.")
    max_sessions: int = Field(256, ge=1, description="Caches kept at most (LRU beyond).")
    batch_wait_s: float = Field(
        0.01, ge=0, le=1, description="How long a batch may wait for calls of active sessions."
    )
    max_batch_size: int = Field(32, ge=1, le=1024)
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the model runs; cuda needs a GPU per replica (per TP rank)."
    )
    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks the model is sharded over (one GPU each on cuda); "
        "must divide the model's attention heads, KV heads and MLP width.",
    )
    tp_placement: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Placement strategy of the replica and its TP ranks."
    )
    tp_init_timeout_s: float = Field(
        INIT_TIMEOUT_S,
        gt=0,
        description="How long the TP group may take to form (the ranks' resources, loading "
        "their shards, the barrier after it: ranks loading a large model finish minutes apart), "
        "and the timeout of each collective of the group; a call that hangs is cut after 600 s.",
    )
    session_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Memory the sessions' KV caches may take on this replica's device (per TP "
        "rank), the copies a batched forward makes included; the router admits decodes "
        "against it (HTTP 429 past it, 400 for one that never fits; deployments/api/admission.py). "
        "None: session_memory_fraction of the device's free memory when the replica starts.",
    )
    allocator: Allocator = Field(
        "jemalloc",
        description="The replica process's malloc: jemalloc (Ray's, preloaded: "
        "RSS flat under shapes that change batch to batch) or system (glibc's); "
        "deployments/replicas/allocator.py.",
    )
    primitive_cache: int | None = Field(
        128,
        ge=0,
        le=1_000_000,
        description="Entries of each matmul primitive cache in the replica process (oneDNN's, "
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY, and PyTorch's in front of it, LRU_CACHE_CAPACITY): "
        "one per matmul shape met, ~0.3 MiB each. Their default 1024 filled over ~20 minutes "
        "of load; 0 rebuilds every primitive (a third slower); None: the libraries' default. "
        "deployments/replicas/allocator.py.",
    )
    batch_invariant: bool = Field(
        True,
        description="A session's outputs in a batched forward are bit-identical to its forward "
        "alone, so a seeded request draws the tokens it draws in-process whatever it is batched "
        "with (bfloat16 on CPUs: small sessions' linear rows in calls of at most 32 rows). "
        "false: large batches run faster and seeded tokens depend on the batch mates. "
        "dsbd_core/models/row_chunks.py.",
    )
    decode_path: Literal["auto", "dynamic", "static"] = Field(
        "auto",
        description="dynamic: packed forests over growing per-session caches (batch-invariant "
        "rows); static: fixed-shape buckets over a preallocated KV pool, captured as CUDA "
        "graphs on cuda (a seeded request's last bits then depend on its batch mates); auto: "
        "static on cuda, dynamic on cpu. A tensor-parallel model runs the dynamic path. "
        "dsbd_core/models/decode_path.py.",
    )
    session_memory_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The share of the device's free memory at start-up (after loading the "
        "model) that is the session budget when session_memory_bytes is not set.",
    )


def worker_bundle(threads: int, device: str) -> dict[str, float]:
    """The resources of one rank: its CPU threads, and one GPU when it runs on CUDA."""
    bundle: dict[str, float] = {"CPU": float(threads)}
    if device == "cuda":
        bundle["GPU"] = 1.0
    return bundle
