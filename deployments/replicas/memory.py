"""What a model replica reports of its memory: one beam's KV bytes per cache column and the
session budget it admits against (`replica_memory`, the replica's `info["memory"]`).

The ingress turns these figures into admission (deployments/api/admission.py: a decode's charge,
the 400 for one that never fits, the 429 for one that does not fit now); the replicas only
measure and report, so they import nothing of the HTTP side.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

WORKING_COPIES = (
    4  # a session's KV caches as held during a batched forward (deployments/api/admission.py)
)


def kv_bytes_per_token(config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV-cache bytes of one beam's cache column on one device: layers x 2 x KV heads x head
    dim x dtype bytes, the KV heads split over `tp_size` ranks (a transformers config)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    layers = int(text.num_hidden_layers)
    itemsize = torch.empty(0, dtype=dtype).itemsize
    return layers * 2 * max(1, kv_heads // tp_size) * head_dim * itemsize


def device_free_bytes(device: str) -> int:
    """Memory free for new allocations on `device` now: available RAM on cpu, the GPU's free
    memory on cuda (the process's current GPU)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info()[0])
    return int(psutil.virtual_memory().available)


def replica_memory(
    kv_per_token: int, configured: int | None, fraction: float, free_bytes: int
) -> dict[str, Any]:
    """What a replica reports in `info["memory"]`: its per-token KV bytes and its budget."""
    if configured is not None:
        budget, source = configured, "session_memory_bytes"
    else:
        budget = int(fraction * free_bytes)
        source = f"session_memory_fraction={fraction} of {free_bytes / 2**30:.2f} GiB free at start"
    return {
        "kv_bytes_per_token": kv_per_token,
        "working_copies": WORKING_COPIES,
        "session_memory_bytes": budget,
        "source": source,
    }
