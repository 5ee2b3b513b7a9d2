"""Does Ray's object store or its GCS hold more and more under steady serving load?

The sixth 30-minute soak (docs/history/RELIABILITY-chronicle.md section 10) found every dsbd
process flat but two
of Ray's own over the 2 % target: the raylet (+3.1 MiB, 2.6 of them pages of the shared object
store it touched) and the GCS server (+2.4 MiB). Pages touched for the first time are bounded by
the store's size; objects that are never freed are a leak that fills the store over weeks. This
tells them apart: the soak's load (`dsbd bench load`'s clients, `--clients` back to back)
against the embedded `dsbd serve`, and every `--sample-s` the node's own Prometheus metrics
(the metrics agent on loopback: objects in the store and their bytes, by location) beside the
raylet's and the GCS server's RSS, private and shared. Objects and bytes that stay flat while
the raylet's shared pages grow mean first-touch pages, not kept objects.

    # 10 minutes, writes results/object_store.json beside this script
    .venv/bin/python benchmarks/investigations/memory/object_store.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from dsbd import server_process
from dsbd.bench import load
from dsbd.bench.load import LoadConfig, Record, every
from dsbd.bench.soak import growth, sample

# Ray's node metrics kept (summed over their label sets, per location): the object store's, and
# the GCS task manager's (task events the GCS keeps for the dashboard, capped by Ray)
METRICS = (
    "ray_object_store_memory",
    "ray_object_store_num_local_objects",
    "ray_object_store_used_memory",
    "ray_object_store_available_memory",
    "ray_gcs_task_manager",
)
_LINE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>[-0-9.e+]+)$")


def node_metrics(url: str) -> dict[str, float]:
    """The node's metrics of `METRICS`, keyed `name` or `name[Location]` (or `[Type]`)."""
    with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match or not match["name"].startswith(METRICS):
            continue
        location = re.search(r'(?:Location|Type)="([^"]*)"', match["labels"] or "")
        key = match["name"] + (f"[{location[1]}]" if location else "")
        out[key] = out.get(key, 0.0) + float(match["value"])
    return out


def ray_processes(pid: int) -> dict[str, dict[str, int]]:
    """RSS, private and shared, of the raylet and the GCS server."""
    return {
        name.split()[0]: parts
        for name, parts in sample(pid).items()
        if name.startswith(("raylet", "gcs_server"))
    }


async def run(
    url: str, pid: int, metrics: str, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    config = LoadConfig(
        url=url,
        clients=args.clients,
        duration_s=args.duration,
        model=model,
        max_tokens=8,
        request_timeout_s=300.0,
    )
    records: list[Record] = []
    samples: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        t0 = time.monotonic()
        done = asyncio.Event()

        async def take() -> None:
            store = await asyncio.to_thread(node_metrics, metrics)
            processes = await asyncio.to_thread(ray_processes, pid)
            flat = {f"{p}.{k}": v for p, d in processes.items() for k, v in d.items()}
            samples.append({"t": round(time.monotonic() - t0, 1), **store, **flat})

        sampler = asyncio.create_task(every(args.sample_s, done, take))
        await asyncio.gather(
            *(
                load.client(http, config, i, t0, t0 + args.duration, records)
                for i in range(args.clients)
            )
        )
        done.set()
        await sampler
    window = [s for s in samples if s["t"] >= samples[-1]["t"] - args.window]
    keys = sorted({k for s in window for k in s if k != "t" and all(k in w for w in window)})
    report = {
        k: growth(
            [s["t"] for s in window],
            [s[k] for s in window],
            2**20 if k.endswith(("rss", "pss", "anon", "shmem", "memory")) or "memory[" in k else 1,
        )
        for k in keys
    }
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": args.duration,
        "clients": args.clients,
        "window_s": args.window,
        "requests": len(records),
        "ok": sum(r.status == 200 for r in records),
        "growth_in_window": report,
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--window", type=float, default=300.0, help="seconds measured at the end")
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "object_store.json",
    )
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"dsbd-object-store-{os.getpid()}"
    server = server_process.start(workdir)
    metrics = json.loads((workdir / "ready").read_text())["metrics_url"]
    print(f"dsbd serve at {server.url} (pid {server.pid}), metrics {metrics}", flush=True)
    try:
        results = asyncio.run(run(server.url, server.pid, metrics, server.model, args))
    finally:
        server_process.stop(server)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("requests", "ok", "growth_in_window")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
