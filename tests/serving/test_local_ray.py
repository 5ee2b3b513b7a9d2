"""Ray started by dsbd opens no connection to anything but loopback.

The whole process tree (driver, GCS, raylet, workers, Serve proxy and replicas) runs under
`strace -f`, which records every connect()/sendto()/sendmsg() with its address, including the
short-lived DNS and metadata probes a socket-table poll would miss. A real Serve deployment is
deployed and called over HTTP on loopback while it is traced.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.loopback import is_loopback, peers, strace

SCRIPT = textwrap.dedent(
    """
    import json, os, urllib.request
    from ray import serve
    from deployments.local_ray import start_local_ray, stop_local_ray

    before = os.environ.get("HOME")
    start_local_ray(num_cpus=2)
    made = os.environ["HOME"]
    try:
        @serve.deployment
        class Echo:
            async def __call__(self, request):
                return {"ok": True, "body": (await request.json())}

        serve.run(Echo.bind(), route_prefix="/echo")
        req = urllib.request.Request("http://127.0.0.1:8000/echo", data=b'{"x": 1}',
                                     headers={"Content-Type": "application/json"})
        print("RESPONSE", urllib.request.urlopen(req, timeout=60).read().decode())
    finally:
        stop_local_ray()
    print("HOMES", json.dumps([before, made, os.environ.get("HOME"), os.path.exists(made)]))
    """
)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_ray_serve_round_trip_touches_only_loopback(tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    completed = subprocess.run(
        [*strace(trace_dir), sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    response = next(x for x in completed.stdout.splitlines() if x.startswith("RESPONSE "))
    assert json.loads(response.removeprefix("RESPONSE ")) == {"ok": True, "body": {"x": 1}}
    # Ray ran with a HOME of its own, removed once Ray stopped; the process has its HOME back
    homes = next(x for x in completed.stdout.splitlines() if x.startswith("HOMES "))
    before, made, after, left = json.loads(homes.removeprefix("HOMES "))
    assert made != before and Path(made).name.startswith("dsbd-ray-home-"), homes
    assert after == before and not left, homes
    addresses = peers(trace_dir)
    assert addresses, "the trace saw no network address at all: is strace recording?"
    outside = sorted(a for a in addresses if not is_loopback(a))
    assert not outside, f"non-loopback connections attempted: {outside}"


def test_ray_processes_keep_the_users_model_caches(tmp_path: Path, monkeypatch) -> None:
    """Ray's HOME is replaced; the model caches must still be the user's (found by replicas)."""
    from deployments.local_ray import loopback_environment
    from dsbd_core.models import cache_root

    monkeypatch.delenv("DSBD_CACHE_DIR", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    env = loopback_environment(tmp_path / "ray-home")
    assert env["HOME"] == str(tmp_path / "ray-home")
    assert env["DSBD_CACHE_DIR"] == str(cache_root())
    assert env["HF_HOME"] == str(Path.home() / ".cache" / "huggingface")


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, os, psutil, sys, time
    from deployments.local_ray import GCS_HISTORY_CAPS, start_local_ray, stop_local_ray

    from dsbd.bench.smaps_census import census  # glibc's thread arenas among the mappings

    def thread_arenas(pid):
        return census(pid).get("malloc_arenas", {}).get("count", 0)

    start_local_ray(num_cpus=1, object_store_mib=80)
    try:
        time.sleep(5)  # the metrics agent's threads start (29; 15 thread arenas by default)
        seen = {}
        for child in psutil.Process().children(recursive=True):
            title = " ".join(child.cmdline())
            if "DashboardAgent" in title or "dashboard/agent.py" in title:
                # its title overwrites its environ: what it got shows as the arenas it made
                jemalloc = "libjemalloc" in open(f"/proc/{child.pid}/maps").read()
                seen["agent"] = {"thread_arenas": thread_arenas(child.pid), "jemalloc": jemalloc}
            if child.name() in ("gcs_server", "raylet"):
                environ = child.environ()
                status = open(f"/proc/{child.pid}/status").read().split("\\n")
                shmem = next(int(x.split()[1]) for x in status if x.startswith("RssShmem:"))
                jemalloc = "libjemalloc" in open(f"/proc/{child.pid}/maps").read()
                seen[child.name()] = {"malloc_conf": environ.get("MALLOC_CONF"),
                                      "arena_max": environ.get("MALLOC_ARENA_MAX"),
                                      "shmem_kib": shmem, "jemalloc": jemalloc,
                                      "caps": {k: v for k, v in environ.items()
                                               if k in GCS_HISTORY_CAPS}}
        print("SEEN", json.dumps(seen))
    finally:
        stop_local_ray()
    """
)


def test_rays_gcs_gets_one_jemalloc_arena_and_the_store_is_touched_at_start() -> None:
    """The fix for Ray's own processes' growth under load (docs/history/RELIABILITY-chronicle.md
    section 10, the
    seventh soak): the GCS server runs Ray's jemalloc with freed pages given back at once, the
    raylet with jemalloc's defaults (the settings cost it a fifth of the throughput), and the
    object store `dsbd serve` sizes is all touched when the raylet starts (its shared pages no
    longer grow as objects land on new ones). Without the settings the raylet held ~1 MiB of
    the store and the GCS had no MALLOC_CONF. Ray's Python processes on glibc's malloc get two
    arenas (the metrics agent's thread arenas' high-water mark, the ninth and tenth soaks)."""
    from deployments.local_ray import (
        GCS_HISTORY_CAPS,
        GLIBC_MALLOC_ARENAS,
        RAY_PROCESS_MALLOC_CONF,
    )

    completed = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    line = next(x for x in completed.stdout.splitlines() if x.startswith("SEEN "))
    seen = json.loads(line.removeprefix("SEEN "))
    assert set(seen) == {"gcs_server", "raylet", "agent"}, seen
    assert seen["gcs_server"]["jemalloc"] and seen["raylet"]["jemalloc"], seen
    assert seen["gcs_server"]["malloc_conf"] == RAY_PROCESS_MALLOC_CONF, seen
    assert seen["raylet"]["malloc_conf"] is None, seen
    assert seen["raylet"]["shmem_kib"] >= 80 * 1024, seen["raylet"]
    # the GCS remembers 1,000 actors and workers gone, not 100,000
    # (benchmarks/investigations/memory/gcs_actor_churn.py at commit ad6d273)
    assert seen["gcs_server"]["caps"] == GCS_HISTORY_CAPS, seen["gcs_server"]
    # Ray's metrics agent runs on glibc's malloc with one thread arena beside the main one, not
    # one per thread (15 at start, 8-10 MiB after minutes of load: the ninth and tenth soaks)
    assert seen["raylet"]["arena_max"] == GLIBC_MALLOC_ARENAS, seen["raylet"]
    assert not seen["agent"]["jemalloc"] and seen["agent"]["thread_arenas"] <= 1, seen["agent"]
