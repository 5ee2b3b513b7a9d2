"""Which decode path a model runs on: the dynamic one (`TransformerScorer`: packed forests, a
`DynamicCache` per session, batch-invariant rows) or the static one (`StaticScorer`: fixed
bucket shapes over a preallocated KV pool, captured as CUDA graphs).

`auto` is static on CUDA, where a forward is bound by kernel launches and graphs remove them, and
dynamic on CPU, where a forward is bound by arithmetic: the static path computes its padding slots
and rows too, and compiling a CPU model costs minutes per bucket
(`benchmarks/investigations/static_path/static_path_cpu.py` measures both paths on this machine).
Every entry point (`dsbd generate`, `bench`, `batch`, the serving replicas) builds its scorers
here, and the cost model's calibration is keyed by the path and measured on it.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import PreTrainedModel

from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer

DecodePath = Literal["auto", "dynamic", "static"]
DECODE_PATHS: tuple[str, ...] = ("auto", "dynamic", "static")


def resolve_decode_path(name: str, device: torch.device | str) -> str:
    """`dynamic` or `static`: what `name` means on `device` (ValueError naming the allowed)."""
    if name not in DECODE_PATHS:
        raise ValueError(f"decode_path={name!r}: allowed: {', '.join(DECODE_PATHS)}")
    if name != "auto":
        return name
    return "static" if torch.device(device).type == "cuda" else "dynamic"


def make_scorer(
    model: PreTrainedModel,
    path: str = "auto",
    *,
    batch_invariant: bool = True,
    compile: str | None = None,
) -> TransformerScorer:
    """The scorer of `model` on `path` (auto: by the model's device); `compile`: how the
    static path runs its buckets (`static_step.COMPILE_MODES`; None: the device's default)."""
    if resolve_decode_path(path, model.device) == "static":
        return StaticScorer(model, compile=compile)
    return TransformerScorer(model, batch_invariant=batch_invariant)
