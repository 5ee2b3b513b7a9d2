"""Does Ray's GCS server keep memory for every actor that comes and goes?

The eighth 30-minute soak (docs/history/RELIABILITY-chronicle.md section 10) found the GCS server's
RSS creeping
+2.9 % (~1.5 MiB) over a window in which Serve added a third router replica and removed it again,
while its own state dump showed flat tables (one destroyed actor more). Serve replicas come and
go for as long as a server runs (autoscaling, a replica that dies and is replaced), so memory
kept per actor would grow over weeks. This makes many actors come and go on the project's
local Ray (`deployments.local_ray.start_local_ray`, the GCS on the settings `dsbd serve`
gives it): `--cycles` times, create a named actor whose constructor gets `--payload-kib` of
arguments (a Serve replica gets its deployment's pickled definition and options), call it once,
kill it; every `--sample-every` cycles record the GCS server's RSS and private (`anon`) memory.
Memory per cycle that never stops growing is kept per actor; a plateau is a high-water mark.

    # writes results/ray_memory/gcs_churn.json beside this script
    .venv/bin/python benchmarks/investigations/memory/gcs_actor_churn.py
    # Ray's own caps (100,000 each) instead of deployments.local_ray.GCS_HISTORY_CAPS:
    env RAY_maximum_gcs_destroyed_actor_cached_count=100000 \\
        RAY_maximum_gcs_dead_worker_cached_count=100000 \\
        RAY_task_events_max_num_task_in_gcs=100000 \\
        .venv/bin/python benchmarks/investigations/memory/gcs_actor_churn.py \\
        --cycles 300 --sample-every 50 --out F

Writes `--out`: the settings, the samples (cycle, seconds, rss, anon) and the growth per
hundred actors after the first `--sample-every` cycles (warm-up) and over the second half of
the cycles (a cap reached levels it off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, run as a script
from deployments.local_ray import GCS_HISTORY_CAPS, start_local_ray, stop_local_ray  # noqa: E402
from dsbd.bench.soak import rss_parts  # noqa: E402


def gcs_pid() -> int:
    """The GCS server this process's Ray started (a child of the driver)."""
    for child in psutil.Process().children(recursive=True):
        if child.name().startswith("gcs_server"):
            return child.pid
    raise RuntimeError("no gcs_server process under this driver")


def gcs_memory(pid: int) -> dict[str, int]:
    return {"rss": psutil.Process(pid).memory_info().rss, **rss_parts(pid)}


def churn(cycles: int, payload_kib: int, sample_every: int) -> list[dict[str, Any]]:
    """Create, call and kill `cycles` named actors; the GCS's memory every `sample_every`."""
    import ray

    @ray.remote(num_cpus=0)
    class Replica:
        def __init__(self, definition: bytes) -> None:
            self.size = len(definition)

        def ping(self) -> int:
            return self.size

    pid, started = gcs_pid(), time.monotonic()
    definition = os.urandom(payload_kib * 1024)
    samples = [{"cycle": 0, "s": 0.0, **gcs_memory(pid)}]
    for cycle in range(1, cycles + 1):
        actor = Replica.options(name=f"replica-{cycle}", namespace="churn").remote(definition)
        assert ray.get(actor.ping.remote()) == len(definition)
        ray.kill(actor)
        if cycle % sample_every == 0:
            time.sleep(0.5)  # the GCS hears of the death asynchronously
            samples.append(
                {"cycle": cycle, "s": round(time.monotonic() - started, 1), **gcs_memory(pid)}
            )
            print(
                f"{cycle} actors: GCS RSS {samples[-1]['rss'] / 2**20:.1f} MiB, anon "
                f"{samples[-1].get('anon', 0) / 2**20:.1f} MiB",
                flush=True,
            )
    return samples


def per_hundred(samples: list[dict[str, Any]], key: str, start: int = 1) -> float:
    """KiB the GCS gained per 100 actors, from sample `start` (1: the first after warm-up) to
    the last."""
    first, last = samples[start], samples[-1]
    actors = last["cycle"] - first["cycle"]
    return round((last[key] - first[key]) / 1024 * 100 / actors, 1) if actors else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--payload-kib", type=int, default=64)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "ray_memory" / "gcs_churn.json",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start_local_ray(num_cpus=2)
    try:
        samples = churn(args.cycles, args.payload_kib, args.sample_every)
    finally:
        stop_local_ray()
    caps = {name: os.environ.get(name, "Ray's default") for name in GCS_HISTORY_CAPS}
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cycles": args.cycles,
        "payload_kib": args.payload_kib,
        "gcs_history_caps": caps,
        "gcs_malloc_conf": os.environ.get("RAY_JEMALLOC_CONF"),
        "rss_kib_per_100_actors": per_hundred(samples, "rss"),
        "anon_kib_per_100_actors": per_hundred(samples, "anon"),
        "rss_kib_per_100_actors_second_half": per_hundred(samples, "rss", len(samples) // 2),
        "load_after": os.getloadavg()[0],
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
