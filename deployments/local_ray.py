"""Start (and stop) a local Ray that only ever talks over loopback.

Ray started plainly reaches outside even with the dashboard off and usage stats disabled: its
usage-stats code probes cloud metadata (HTTP to 169.254.169.254, DNS for metadata.google.internal)
when `~/ray_bootstrap_config.yaml` is missing, and its processes talk to each other over the
machine's own non-loopback address (measured on this project's machines). The checked fix, applied
here: point HOME at a folder whose `ray_bootstrap_config.yaml` says `provider: {type: local}`,
disable usage stats, and bind the node to 127.0.0.1.

Binding alone is not enough in Ray 2.60 (seen in tests/serving/test_local_ray.py's syscall
trace): `ray.init` passes the requested node address through `resolve_ip_for_localhost`, which
replaces any loopback address by the machine's routable one (found by a UDP "connect" to
8.8.8.8), so the GCS, the raylet and every worker talked gRPC over 192.0.2.2.
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` turns Ray's multi-node mode off, and with it that
replacement: every process then uses 127.0.0.1. A single-node Ray is what a local `dsbd serve`
needs; clusters (KubeRay) start Ray their own way.

The temporary HOME `start_local_ray` makes is removed, and the process's own HOME restored,
when Ray stops (`stop_local_ray`, `release_home`).

Because HOME is replaced, the model caches are passed on explicitly (`DSBD_CACHE_DIR`,
`HF_HOME`, resolved with the user's HOME): otherwise every replica would look for installed
presets in the empty temporary HOME (found when serving the Qwen pair).

Every dsbd entry point that starts Ray (tests, `dsbd serve`, batch jobs) goes through
`start_local_ray`.

Memory of Ray's own processes under steady load (figures: docs/history/RELIABILITY-chronicle.md
section 10): the GCS server's RSS creeps while its tables stay flat, because the jemalloc Ray
preloads into it keeps freed pages per arena for seconds; and the raylet's plasma allocator
touches pages of the shared store for the first time as objects come and go (placement, not
retention, bounded by the store's size). So the GCS server gets one jemalloc arena that returns
freed pages at once (`ray_process_environment`), and `dsbd serve` starts a store sized to what
serving needs, all of it touched at start (`object_store_mib`, `--object-store-mib`). The raylet
keeps jemalloc's defaults: with the GCS's settings it serves markedly fewer requests (it handles
every object a call puts).

The GCS also keeps a record of every actor and worker that is gone and of every task's events,
up to 100,000 of each by default (for the dashboard and `ray list`): ~18 KiB per actor that came
and went (benchmarks/investigations/memory/gcs_actor_churn.py), so a server whose replicas
autoscale or get replaced for weeks would grow its GCS towards GiBs before the caps.
`GCS_HISTORY_CAPS` keeps the last 1,000 actors and workers and 10,000 tasks' events: the GCS's
memory then levels off.

Ray's Python processes that run on glibc's malloc (the node's metrics agent, the runtime-env
agent, Serve's controller and proxy; the model, ingress and router replicas run Ray's
jemalloc) start a thread arena per thread that allocates, up to 8 per core, each keeping its
high-water mark, so their memory wanders up over hours. `MALLOC_ARENA_MAX`
(`GLIBC_MALLOC_ARENAS`) caps them at two, on every node, which keeps them flat. Replicas left on
glibc (`allocator: system`) get glibc's own count back (deployments.replicas.allocator).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deployments.gcs_ft import GcsRedis

LOOPBACK = "127.0.0.1"
BOOTSTRAP_CONFIG = "provider: {type: local}\n"

# jemalloc's settings for Ray's GCS server (Ray preloads its jemalloc into the GCS and the
# raylet and hands RAY_JEMALLOC_CONF as MALLOC_CONF to the processes RAY_JEMALLOC_PROFILE
# names): one arena, freed pages given back at once, so its RSS follows its live bytes.
RAY_PROCESS_MALLOC_CONF = "narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0"
RAY_MALLOC_PROCESSES = "gcs_server"
# What the GCS remembers of actors and workers that are gone and of tasks' events (Ray's
# defaults: 100,000 each, ~18 KiB per actor that came and went): bounded far lower.
GCS_HISTORY_CAPS = {
    "RAY_maximum_gcs_destroyed_actor_cached_count": "1000",
    "RAY_maximum_gcs_dead_worker_cached_count": "1000",
    "RAY_task_events_max_num_task_in_gcs": "10000",
}
# glibc's malloc arenas for every process on a node that runs on it (the main arena and one
# thread arena); a user's own MALLOC_ARENA_MAX wins.
GLIBC_MALLOC_ARENAS = "2"
# How often the controller of a local Serve walks its deployments (Ray's default: every 0.1 s;
# clusters keep it). Idle, with 22 replicas, the walk took a tenth of a core; every 0.5 s,
# about a third of that (benchmarks/results/suite_time_epyc.json, "serve_controller_idle").
# A replica lost or a deployment changed is acted on at most 0.4 s later; requests never wait
# on the walk.
SERVE_CONTROL_LOOP_S = "0.5"
# Ray starts idle Python workers when the first driver connects, for tasks that might come
# (`prestart_worker_first_driver`); Serve's controller, proxy and replicas never took one. Off,
# a one-application server starts with one idle worker fewer (the one left ran the
# application's build task): ~5 CPU-s less to start and ~0.5 CPU-s a minute less idle (2-core
# AMD EPYC; benchmarks/results/suite_time_epyc.json, "idle_workers"). A user's setting wins.
PRESTART_WORKERS = "0"
# The local node's settings above, each a default that a user's own value replaces.
LOCAL_NODE_DEFAULTS = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": SERVE_CONTROL_LOOP_S,
    "RAY_prestart_worker_first_driver": PRESTART_WORKERS,
}
# Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES).
OBJECT_STORE_MINIMUM_MIB = 75

# The temporary HOMEs `start_local_ray` made, each with the HOME it replaced, until
# `release_home` removes them.
_MADE_HOMES: list[tuple[Path, str | None]] = []


def _temporary_home() -> Path:
    """A new folder under the system's temporary directory to serve as Ray's HOME."""
    return Path(tempfile.mkdtemp(prefix="dsbd-ray-home-"))


def loopback_environment(home: Path | None = None) -> dict[str, str]:
    """Environment variables that keep Ray (and its child processes) on loopback.

    Ray keeps its auth token under `$HOME/.ray` and `serve run --address` needs the same HOME,
    so callers that start Ray in one process and talk to it from another pass this HOME on.
    """
    from dsbd_core.models import cache_root

    # Resolved with the user's HOME, before it is replaced: replicas must find the models that
    # `dsbd models prepare/install` put there (presets, converted GGUFs, the HF cache).
    models, hugging_face = cache_root(), Path.home() / ".cache" / "huggingface"
    home = home or _temporary_home()
    home.mkdir(parents=True, exist_ok=True)
    (home / "ray_bootstrap_config.yaml").write_text(BOOTSTRAP_CONFIG)
    return {
        "HOME": str(home),
        "DSBD_CACHE_DIR": str(models),
        "HF_HOME": os.environ.get("HF_HOME") or str(hugging_face),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        # Single-node mode: keeps Ray from swapping 127.0.0.1 for the routable address.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # Serve gives its HTTP proxy 5 s to report ready, then kills and restarts it; on a busy
        # 2-core machine (measured: under strace and a parallel job) the proxy needs longer.
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
        **{name: os.environ.get(name, value) for name, value in LOCAL_NODE_DEFAULTS.items()},
    }


def ray_process_environment() -> dict[str, str]:
    """Environment variables that give Ray's GCS server the jemalloc settings of
    `RAY_PROCESS_MALLOC_CONF` (no other process gets them) and the caps of its history of
    processes and tasks gone (`GCS_HISTORY_CAPS`), and every process of the node on glibc's
    malloc `GLIBC_MALLOC_ARENAS` arenas."""
    return {
        "MALLOC_ARENA_MAX": GLIBC_MALLOC_ARENAS,
        "RAY_JEMALLOC_CONF": RAY_PROCESS_MALLOC_CONF,
        "RAY_JEMALLOC_PROFILE": RAY_MALLOC_PROCESSES,
        **GCS_HISTORY_CAPS,
    }


def ray_process_settings() -> dict[str, str]:
    """`ray_process_environment()` with the value this process's environment already holds in
    place of each default: a user's own settings win, in `dsbd serve` and `dsbd ray-env` alike."""
    return {name: os.environ.get(name, value) for name, value in ray_process_environment().items()}


def start_local_ray(
    *,
    num_cpus: int | None = None,
    home: Path | None = None,
    metrics_export_port: int | None = None,
    object_store_mib: int | None = None,
    gcs_redis: GcsRedis | None = None,
    **init: Any,
) -> Any:
    """`ray.init` on this machine with loopback-only networking; returns Ray's context.

    The environment is set in this process before Ray starts, so every Ray process inherits it.
    `metrics_export_port`: where the node's metrics agent serves Prometheus `/metrics` (None or
    0: a free port, see `metrics_url`); on this loopback node it binds 127.0.0.1.
    `object_store_mib`: the shared object store's size, every page of it touched when the
    raylet starts (Ray's `preallocate_plasma_memory`), so the raylet's memory does not grow as
    objects land on pages not used before; None or 0: Ray's default (30 % of the machine's
    memory, touched as used), which batch jobs keep for Ray Data's blocks.
    `gcs_redis`: the GCS keeps its tables in that Redis and can be started again without losing
    the cluster (deployments/gcs_ft.py; `GcsWatch` does the restarting).
    """
    if home is None:  # a HOME of its own, removed when Ray stops (`release_home`)
        home = _temporary_home()
        _MADE_HOMES.append((home, os.environ.get("HOME")))
    os.environ.update(loopback_environment(home))
    if gcs_redis is not None:
        os.environ.update(gcs_redis.environment())
        if gcs_redis.password:
            init["_redis_password"] = gcs_redis.password
    os.environ.update(ray_process_settings())  # a user's own values win
    # Read by the raylet from its environment; set either way, so that a later Ray started by
    # this process without a size does not pre-touch 30 % of the machine's memory.
    os.environ["RAY_preallocate_plasma_memory"] = "1" if object_store_mib else "0"
    import ray  # imported late: child processes read the environment when they start
    from ray._private import ray_constants

    # This process may have imported ray before the environment was set; the constant is read
    # at call time by `services.get_node_ip_address`, so align it with the environment.
    ray_constants.ENABLE_RAY_CLUSTER = False

    return ray.init(
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        num_cpus=num_cpus,
        configure_logging=False,
        _metrics_export_port=metrics_export_port or None,
        object_store_memory=object_store_mib * 2**20 if object_store_mib else None,
        **init,
    )


def metrics_url() -> str | None:
    """The Prometheus endpoint of this node's Ray metrics agent (Ray Serve metrics included)."""
    import ray

    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port and port > 0:
            return f"http://{node['NodeManagerAddress']}:{port}/metrics"
    return None


def stop_local_ray(*, shut_serve_down: bool = True) -> None:
    """Shut Serve (if running) and Ray down; leaves no Ray process behind.

    `shut_serve_down=False` skips Serve's own shutdown: for a driver that would wait its full
    30 s for a controller exit it cannot hear (after a GCS restart: deployments/gcs_ft.py;
    Ray's shutdown then stops the replicas with everything else), and for one that ran no
    Serve (a batch job)."""
    import ray

    if ray.is_initialized():
        try:
            if shut_serve_down:
                from ray import serve

                serve.shutdown()
        finally:
            ray.shutdown()
    release_home()


def release_home() -> None:
    """Remove the temporary HOMEs `start_local_ray` made and give this process its HOME back,
    once Ray is down (the HOME holds Ray's bootstrap config and auth token, which nothing reads
    after that), so that no server start or batch job leaves a folder under /tmp."""
    while _MADE_HOMES:
        home, previous = _MADE_HOMES.pop()
        if previous is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = previous
        shutil.rmtree(home, ignore_errors=True)
