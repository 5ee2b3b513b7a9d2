"""The memory settings of the model replicas: jemalloc (the one Ray ships, preloaded) and the
capacity of the matmul primitive caches.

Why jemalloc: under steady load glibc's malloc keeps the pages freed by batches of ever-changing
shapes, so a replica's RSS grows in steps it never gives back; jemalloc returns them, and holds
less. The serving classes leak nothing per request (tests/serving/test_replica_leak.py); fewer glibc
arenas, oneDNN's primitive cache off and a fixed mmap threshold were tried and are no fix or too
slow. benchmarks/investigations/memory/memory_shapes.py reproduces the growth in minutes; the
soaks' figures are in docs/history/RELIABILITY-chronicle.md section 10.

A replica's process gets `LD_PRELOAD` through its Ray `runtime_env` (`env_vars` are in the
environment the worker is started with, so the dynamic loader sees them; the tensor-parallel
rank actors a replica creates inherit it), merged into the application's own runtime_env.
`allocator: system` keeps glibc's malloc; so does a Ray without the bundled library (the
replica then reports `system`). Such a replica gets glibc's own number of malloc arenas
(`MALLOC_ARENA_MAX=0`) back from the two that `dsbd serve` gives Ray's own processes
(deployments.local_ray), unless the application's runtime_env names a value of its own: its
threads' arenas were measured as they come, not as two.

The other holders of memory per batch shape are two caches of matmul primitives: oneDNN's
own (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and the one PyTorch keeps in front of it for its
bfloat16/int8 matmuls (ideep's, `LRU_CACHE_CAPACITY`), 1024 entries each by default. Every
(rows, in, out) shape a forward meets gets an entry in each (a fraction of a MiB with its
scratchpad and packed operands), and a replica meets new row counts for many minutes, as the
rows vary with the batch mates; capping one cache alone keeps most of that memory
(tests/serving/test_allocator.py). `ModelOptions.primitive_cache` caps both (the variables are read
when the first primitive is built, so they are set in the replica's environment): 128 entries
fill during warm-up; 0 rebuilds every primitive every forward, about a third slower
(benchmarks/investigations/memory/memory_shapes.py).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys
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


# oneDNN's primitive cache, and PyTorch's (ideep's) cache of oneDNN matmuls in front of it
PRIMITIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


# glibc's own number of malloc arenas (8 per core): 0 is glibc's "not set".
GLIBC_DEFAULT_ARENAS = {"MALLOC_ARENA_MAX": "0"}


def replica_env(allocator: Allocator, primitive_cache: int | None = None) -> dict[str, str]:
    """Environment variables that give a replica process `allocator` and primitive caches of
    `primitive_cache` entries each (None: the libraries' defaults)."""
    library = jemalloc_library() if allocator == "jemalloc" else None
    variables = {"LD_PRELOAD": str(library)} if library is not None else dict(GLIBC_DEFAULT_ARENAS)
    if primitive_cache is not None:
        variables.update(dict.fromkeys(PRIMITIVE_CACHE_VARIABLES, str(primitive_cache)))
    return variables


def replica_runtime_env(
    allocator: Allocator, primitive_cache: int | None, inherited: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The runtime_env of a model replica: the application's (`inherited`) with the memory
    settings' variables added to its `env_vars` (the application's MALLOC_ARENA_MAX wins over
    glibc's default count). Serve gives a deployment that sets its own
    runtime_env nothing of the application's but its working_dir, so the application's
    env_vars (an OTLP endpoint, DSBD_FAULT_INJECT) are merged here."""
    variables = replica_env(allocator, primitive_cache)
    merged = dict(inherited or {})
    own = dict(merged.get("env_vars") or {})
    arenas = {name: own[name] for name in GLIBC_DEFAULT_ARENAS if name in own}  # the user's
    merged["env_vars"] = {**own, **variables, **arenas}
    return merged


def serve_controller_options(configured: Mapping[str, Any] | None) -> dict[str, Any]:
    """Serve's `controller_options` for `dsbd serve`: the controller on Ray's jemalloc, and with
    it the proxies it starts (an actor created without a runtime_env inherits its creator's).

    Why: Serve's proxy on glibc keeps growing its thread arena under steady load, as the
    ingress did before it moved to jemalloc (docs/history/RELIABILITY-chronicle.md section 10).
    The application's own `controller_options` win: its env_vars are kept and an LD_PRELOAD of
    its own is not replaced. Without Ray's bundled library the processes keep glibc (and the two
    arenas deployments.local_ray gives Ray's processes).
    """
    options = dict(configured or {})
    runtime_env = dict(options.get("runtime_env") or {})
    own = dict(runtime_env.get("env_vars") or {})
    library = jemalloc_library()
    if library is not None:
        own.setdefault("LD_PRELOAD", str(library))
    if own:
        runtime_env["env_vars"] = own
        options["runtime_env"] = runtime_env
    return options


def primitive_cache_capacity() -> int | None:
    """The primitive caches' capacity this process was given (None: a library's default)."""
    values = {os.environ.get(name) for name in PRIMITIVE_CACHE_VARIABLES}
    value = values.pop() if len(values) == 1 else None
    return int(value) if value is not None and value.isdigit() else None


@functools.cache
def active_allocator() -> Allocator:
    """The allocator this process runs with (jemalloc when its library is mapped; it is
    preloaded or not at all, so one look at the process's maps holds for its life)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "jemalloc" if "libjemalloc" in maps else "system"


_JEMALLOC_STATS = ("allocated", "active", "resident", "retained", "mapped", "metadata")


def allocator_stats() -> dict[str, int]:
    """Bytes by who holds them, to tell a leak from an allocator that keeps pages: for jemalloc
    its `stats.*` counters (allocated: live malloc'd bytes; resident: pages it holds, freed
    ones not yet given back included), for glibc `mallinfo2` (in_use, from_system); and
    Python's live small-object blocks (pymalloc's arenas are mmap'd past either malloc)."""
    stats: dict[str, int] = {"python_blocks": sys.getallocatedblocks()}
    libc = ctypes.CDLL(None)
    if active_allocator() == "jemalloc" and hasattr(libc, "mallctl"):
        epoch = ctypes.c_uint64(1)  # writing the epoch refreshes the cached statistics
        size = ctypes.c_size_t(ctypes.sizeof(epoch))
        libc.mallctl(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), size)
        for name in _JEMALLOC_STATS:
            value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
            if (
                libc.mallctl(
                    f"stats.{name}".encode(),
                    ctypes.byref(value),
                    ctypes.byref(size),
                    None,
                    ctypes.c_size_t(0),
                )
                == 0
            ):
                stats[name] = value.value
    elif hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        stats["in_use"] = info.uordblks + info.hblkhd
        stats["from_system"] = info.arena + info.hblkhd
    return stats


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (every field a size_t)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]
