"""The model replicas' memory settings (deployments/replicas/allocator.py): what reaches their
environment, the allocator statistics they report, and that capping the matmul primitive
caches bounds the memory that new batch shapes keep (issue 21: the draft's live bytes grew for
20 minutes of a soak while the caches filled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deployments.replicas.allocator import (
    PRIMITIVE_CACHE_VARIABLES,
    allocator_stats,
    jemalloc_library,
    replica_env,
    replica_runtime_env,
    serve_controller_options,
)

# bfloat16 linears of `shapes` row counts never met before: jemalloc's live bytes they leave
# behind (the caches' entries; every tensor of the loop is freed).
CHILD = """
import json, sys, torch
from deployments.replicas.allocator import allocator_stats, primitive_cache_capacity
torch.set_num_threads(1)
linear = torch.nn.Linear(576, 1536).to(torch.bfloat16)
live = lambda: allocator_stats()["allocated"]
with torch.inference_mode():
    for rows in range(1, 9):
        linear(torch.randn(rows, 576, dtype=torch.bfloat16))
    before = live()
    for rows in range(9, 9 + int(sys.argv[1])):
        linear(torch.randn(rows, 576, dtype=torch.bfloat16))
    kept = live() - before
print(json.dumps({"kept_mib": kept / 2**20, "capacity": primitive_cache_capacity()}))
"""


def test_replica_env_sets_the_allocator_and_both_cache_capacities() -> None:
    library = jemalloc_library()
    assert library is not None  # the Ray wheel ships it
    env = replica_env("jemalloc", 128)
    assert env["LD_PRELOAD"] == str(library)
    assert all(env[name] == "128" for name in PRIMITIVE_CACHE_VARIABLES)
    assert "MALLOC_ARENA_MAX" not in env  # jemalloc has no glibc arenas
    # glibc's own arena count back from the two Ray's processes get (deployments.local_ray)
    assert replica_env("system", None) == {"MALLOC_ARENA_MAX": "0"}
    assert set(replica_env("system", 0)) == {"MALLOC_ARENA_MAX", *PRIMITIVE_CACHE_VARIABLES}


def test_replica_runtime_env_keeps_the_applications_variables() -> None:
    inherited = {"working_dir": "w", "env_vars": {"DSBD_FAULT_INJECT": "x"}}
    merged = replica_runtime_env("jemalloc", 64, inherited)
    assert merged is not None and merged["working_dir"] == "w"
    assert merged["env_vars"]["DSBD_FAULT_INJECT"] == "x"
    assert merged["env_vars"]["LRU_CACHE_CAPACITY"] == "64"
    assert inherited["env_vars"] == {"DSBD_FAULT_INJECT": "x"}  # not modified
    system = replica_runtime_env("system", None, inherited)
    assert system["env_vars"] == {"DSBD_FAULT_INJECT": "x", "MALLOC_ARENA_MAX": "0"}
    users = {"env_vars": {"MALLOC_ARENA_MAX": "4"}}  # the application's own value wins
    assert replica_runtime_env("system", None, users)["env_vars"] == {"MALLOC_ARENA_MAX": "4"}
    assert inherited["env_vars"] == {"DSBD_FAULT_INJECT": "x"}  # not modified


def test_serve_controller_options_preload_jemalloc_and_keep_the_applications_own() -> None:
    """Serve's controller (and the proxies it starts, which inherit its runtime_env) get Ray's
    jemalloc; an application's controller_options keep their variables and their own
    LD_PRELOAD; without the library nothing is added."""
    library = jemalloc_library()
    assert library is not None  # the Ray wheel ships it
    assert serve_controller_options(None) == {
        "runtime_env": {"env_vars": {"LD_PRELOAD": str(library)}}
    }
    configured = {"runtime_env": {"env_vars": {"OTEL": "1", "LD_PRELOAD": "/mine.so"}}}
    assert serve_controller_options(configured) == configured
    assert configured == {"runtime_env": {"env_vars": {"OTEL": "1", "LD_PRELOAD": "/mine.so"}}}
    kept = serve_controller_options({"runtime_env": {"env_vars": {"OTEL": "1"}}})
    assert kept["runtime_env"]["env_vars"] == {"OTEL": "1", "LD_PRELOAD": str(library)}


def test_serve_controller_options_without_rays_jemalloc(monkeypatch) -> None:
    import deployments.replicas.allocator as allocator

    monkeypatch.setattr(allocator, "jemalloc_library", lambda: None)
    assert serve_controller_options(None) == {}
    configured = {"runtime_env": {"env_vars": {"OTEL": "1"}}}
    assert serve_controller_options(configured) == configured


def test_allocator_stats_under_glibc() -> None:
    stats = allocator_stats()
    assert stats["python_blocks"] > 0
    if "in_use" in stats:  # glibc >= 2.33 has mallinfo2
        assert 0 < stats["in_use"] <= stats["from_system"]


def _kept_mib(primitive_cache: int | None, shapes: int = 300, **extra: str) -> dict:
    env = {**os.environ, **replica_env("jemalloc", primitive_cache), "OMP_NUM_THREADS": "1"}
    if primitive_cache is None:
        for name in PRIMITIVE_CACHE_VARIABLES:
            env.pop(name, None)
    env.update(extra)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(shapes)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="bfloat16 matmuls do not go through oneDNN on this CPU",
)
def test_capped_primitive_caches_keep_no_memory_per_new_shape() -> None:
    """300 new row counts kept, with both caches at 8 entries / only oneDNN's at 8 / the defaults
    (1024 each): 0.2 / 83 / ~180 MiB on an AMX Xeon, -0.1 / 9.3 / 18.1 MiB on an AVX512 Xeon
    without AMX (oneDNN's primitives for AMX hold more per shape)."""
    capped = _kept_mib(8)
    assert capped["capacity"] == 8
    assert capped["kept_mib"] < 8, capped
    default = _kept_mib(None)
    assert default["capacity"] is None
    # what the cap removes, so the test can see it: on every CPU measured the defaults keep 10
    # MiB more than the capped run (whose figure moves by ~0.2 MiB from run to run)
    assert default["kept_mib"] > capped["kept_mib"] + 10, (default, capped)
    onednn_only = _kept_mib(None, ONEDNN_PRIMITIVE_CACHE_CAPACITY="8")  # PyTorch's left at 1024
    print(
        f"kept MiB for 300 new row counts: both caches at 8 {capped['kept_mib']:.1f}, "
        f"only oneDNN's at 8 {onednn_only['kept_mib']:.1f}, defaults {default['kept_mib']:.1f}"
    )
