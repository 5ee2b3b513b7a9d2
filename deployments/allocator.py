"""The memory allocator of the model replicas: jemalloc, the one Ray ships, preloaded.

Why: under steady load the draft replica's RSS grew in steps that were never given back (+2.0 %
and +4.2 % over the last 20 minutes of two 30-minute soaks, docs/RELIABILITY.md section 10),
with no per-request leak in the serving classes (tests/test_replica_leak.py). The serving
path's batching in one process (benchmarks/memory_shapes.py: rounds of 1-8 requests of random
shapes) reproduces it with glibc's malloc (+4.2 % and +5.1 % within two minutes) and not with
jemalloc (-3.2 %: it gives memory back), which also holds 260-380 MiB less and ran 39 rounds to
glibc's 37 in the same time. Neither oneDNN's primitive cache (off: +7.3 %) nor fewer malloc
arenas (`MALLOC_ARENA_MAX=2`: +4.2 % in the soak) is the cause; a fixed mmap threshold of
128 KiB also stops the growth but cost a fifth of the rounds.

A replica's process gets `LD_PRELOAD` through its Ray `runtime_env` (`env_vars` are in the
environment the worker is started with, so the dynamic loader sees them; the tensor-parallel
rank actors a replica creates inherit it), merged into the application's own runtime_env.
`allocator: system` keeps glibc's malloc; so does a Ray without the bundled library (the
replica then reports `system`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

Allocator = Literal["jemalloc", "system"]


def jemalloc_library() -> Path | None:
    """Ray's bundled jemalloc (`ray/core/libjemalloc.so`), if this Ray has one."""
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return None
    library = Path(spec.origin).parent / "core" / "libjemalloc.so"
    return library if library.is_file() else None


def replica_env(allocator: Allocator) -> dict[str, str]:
    """Environment variables that give a replica process `allocator`."""
    library = jemalloc_library() if allocator == "jemalloc" else None
    return {"LD_PRELOAD": str(library)} if library is not None else {}


def replica_runtime_env(
    allocator: Allocator, inherited: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The runtime_env of a model replica: the application's (`inherited`) with the allocator's
    variables added to its `env_vars`; None when the allocator needs none (the replica then
    inherits the application's as usual). Serve gives a deployment that sets its own
    runtime_env nothing of the application's but its working_dir, so the application's
    env_vars (an OTLP endpoint, DSBD_FAULT_INJECT) are merged here."""
    variables = replica_env(allocator)
    if not variables:
        return None
    merged = dict(inherited or {})
    merged["env_vars"] = {**dict(merged.get("env_vars") or {}), **variables}
    return merged


def active_allocator() -> Allocator:
    """The allocator this process runs with (jemalloc when its library is mapped)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "jemalloc" if "libjemalloc" in maps else "system"
