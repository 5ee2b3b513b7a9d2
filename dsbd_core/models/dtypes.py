"""Which floating-point type the models run in: `auto` picks what this machine multiplies fast.

DSBD pays when one target forward over a whole forest (a dozen tokens or more) costs about what
one token costs. That holds where matrix units make a forward memory-bound: bfloat16 on CUDA
and on CPUs with AMX or AVX512-BF16 (measured here, 1 thread: a SmolLM2 forward over 12 new
tokens costs 1.1x a one-token step in bfloat16 and 2.7x in float32: docs/ARCHITECTURE.md,
"Measured facts about CPUs"). On
a CPU without bfloat16 matrix units bfloat16 is emulated and slower than float32, so `auto`
keeps float32 there. float64 is for exactness tests on tiny models.
"""

from __future__ import annotations

from typing import Literal

import torch

DtypeName = Literal["auto", "float32", "bfloat16", "float64"]
DTYPE_NAMES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float64", "float16")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float16": torch.float16,
}


def cpu_has_bf16_matmul() -> bool:
    """True when this CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX512-BF16)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """The dtype `name` means on `device`, and why (printed and recorded with results)."""
    if name not in DTYPE_NAMES:
        allowed = ", ".join(DTYPE_NAMES)
        raise ValueError(f"dtype={name!r}: allowed: {allowed}")
    if name != "auto":
        return DTYPES[name], f"{name} (as asked)"
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16, "auto: bfloat16 (CUDA)"
    if kind == "cpu" and cpu_has_bf16_matmul():
        return torch.bfloat16, "auto: bfloat16 (this CPU has AMX/AVX512-BF16 matrix units)"
    return torch.float32, "auto: float32 (no bfloat16 matrix units on this CPU)"


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of a torch dtype (`torch.bfloat16` -> `bfloat16`)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")
