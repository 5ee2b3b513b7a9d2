"""Soak: steady load against `dsbd serve` for T minutes, the memory of every server process
sampled every 10 s, and its growth after warm-up per process.

A 60 s load run saw the verifier grow +251 MiB (+4.2%) and could not tell a leak from an
allocator's high-water mark (docs/RELIABILITY.md, section 4). A leak keeps growing; a
high-water mark stops once the largest batches have been seen. So: `--clients` clients send
the request mix of `dsbd bench load` back to back for `--duration` seconds (default 30 min),
and every `--sample-s` (10 s) the RSS and PSS of every process of the server (the `dsbd serve`
process and its descendants: Ray's processes, each replica its own) are recorded. Per process
the growth over the last `--window` seconds (default 20 min, after a warm-up of the rest) is
reported as a fraction: the mean of the window's last three samples over the mean of its first
three, minus one (three: one sample can catch a forward's transient peak), with the largest
sample of the window and a least-squares slope per hour. Target (issue 21): <= 2% for every
process. Processes that started during the window (a replica Serve added) are listed apart.

The end-point figure rests on six samples; a process whose live memory follows the work in
flight (the verifier: sessions' KV caches and forwards' activations, +-3 % from one sample to
the next) lands anywhere in about +-2 % by it with no trend at all (-2.3 to +2.1 % over the
soaks since the eighth). So the least-squares fit over all of the window's samples is reported
beside it as `trend` (the fitted line's rise across the window, as a fraction of the same
start) with `trend_se`, its standard error were the samples independent (a floor: neighbours
correlate): a leak raises both figures; noise moves the end points far more than the fit.

    dsbd bench soak                                                   # SmolLM2, 30 min
    dsbd bench soak --url http://127.0.0.1:8000 --pid PID             # a running server
    dsbd bench soak --trends benchmarks/results/soak*.json            # saved soaks side by side

RSS is also split into `anon` (the process's private heap: what a leak grows) and `shmem`
(shared-memory pages it touched: Ray's object store is one, mapped into every process that writes or
reads an object; the raylet's RSS grew by these, +1.8 -> 4.3 MiB in a run, while its private memory
stayed flat). And with every sample the draft and verifier replicas that answer `GET
/v1/dsbd/status` report their allocator's statistics (jemalloc's live `allocated` bytes against the
`resident` pages it holds, Python's live blocks) and their cached sessions: live bytes that grow
with flat Python objects and sessions are a native cache filling (it was two matmul primitive
caches: deployments/replicas/allocator.py); resident growing alone is the allocator.

Writes `--out` (default benchmarks/results/soak.json): duration_s, rss_growth_after_warmup and
pss_growth_after_warmup (and anon_/shmem_) per process, the details, the replicas' statistics'
growth (replica_growth_after_warmup), the requests' outcome and the samples. `--trends FILE...`
reads saved soaks instead and prints both figures per process side by side
(dsbd/bench/soak_trends.py), so that earlier soaks can be put beside new ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from dsbd.bench import load
from dsbd.bench.load import ABANDONED, LoadConfig, Record, every, percentiles
from dsbd.bench.soak_trends import growth, show_trends
from dsbd.common import fail, ray_cpus


def sample(pid: int) -> dict[str, dict[str, Any]]:
    """RSS and PSS of `pid` and each descendant, keyed "name pid" (Ray names replica processes
    by deployment: `dsbd:Verifier`)."""
    from dsbd import server_process

    out = {}
    titles = {pid: "dsbd-serve", **server_process.descendants(pid)}
    for child, title in titles.items():
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(child).memory_full_info()
            name = server_process.process_name(title) if child != pid else "dsbd-serve"
            out[f"{name} {child}"] = {
                "rss": info.rss,
                "pss": getattr(info, "pss", info.rss),
                **rss_parts(child),
            }
    return out


def rss_parts(pid: int) -> dict[str, int]:
    """A process's RSS by kind (Linux /proc/PID/status): `anon` (its private heap: what a
    leak grows) and `shmem` (shared memory pages it touched: Ray's object store, mapped in
    every process that reads or writes an object, is one; bounded by the store's size)."""
    parts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                parts[key[3:].lower()] = int(value.split()[0]) * 1024
    return parts


def last_window(samples: list[tuple[float, Any]], window_s: float) -> list[tuple[float, Any]]:
    """The samples of the last `window_s` seconds (after warm-up), the report's span."""
    end = samples[-1][0]
    return [(t, s) for t, s in samples if t >= end - window_s]


def memory_report(samples: list[tuple[float, dict[str, Any]]], window_s: float) -> dict[str, Any]:
    """Per process: growth over the last `window_s` seconds of samples."""
    if not samples:
        return {"rss_growth_after_warmup": {}, "pss_growth_after_warmup": {}}
    window = last_window(samples, window_s)
    start_names = set(window[0][1])
    span = window[-1][0] - window[0][0]
    report: dict[str, Any] = {"window_s": round(span, 1), "samples": len(window)}
    for kind in ("rss", "pss", "anon", "shmem"):
        per = {}
        for name in sorted(start_names):
            series = [(t, s[name][kind]) for t, s in window if kind in s.get(name, {})]
            if len(series) >= 2 and name in window[-1][1] and kind in window[-1][1][name]:
                per[name] = growth([t for t, _ in series], [v for _, v in series])
        report[f"{kind}_growth_after_warmup"] = {k: v["growth"] for k, v in per.items()}
        report[f"{kind}_trend_after_warmup"] = {k: v["trend"] for k, v in per.items()}
        report[f"{kind}_details"] = per
    total = [sum(v["rss"] for k, v in s.items() if k in start_names) for _, s in window]
    report["rss_total_growth"] = growth([t for t, _ in window], total)
    last = window[-1][1]
    report["started_in_window_mib"] = {
        k: round(v["rss"] / 2**20, 1) for k, v in last.items() if k not in start_names
    }
    report["gone_in_window"] = sorted(start_names - set(last))
    return report


_COUNTS = ("python_blocks", "cached_sessions")  # counted, not bytes


def replica_sample(status: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    """What the replicas that answer say they hold: their allocator's statistics (live
    malloc'd bytes vs pages held, Python's live blocks; deployments/replicas/allocator.py)
    and, for the model replicas, their cached sessions, keyed "side pid"."""
    out: dict[str, dict[str, int]] = {}
    for side in ("draft", "verifier", "router", "ingress"):
        info = (status or {}).get(side)
        if info:
            stats = dict(info.get("allocator_stats") or {})
            if "cached_sessions" in info:
                stats["cached_sessions"] = info["cached_sessions"]
            out[f"{side} {info['pid']}"] = stats
    return out


def replica_report(samples: list[tuple[float, dict[str, Any]]], window_s: float) -> dict[str, Any]:
    """Per replica and statistic: its growth over the last `window_s` seconds. Live bytes
    (`allocated`, `python_blocks`) that grow with `resident` mean objects are kept; `resident`
    growing alone means the allocator keeps freed pages."""
    if not samples:
        return {}
    window = last_window(samples, window_s)
    out: dict[str, Any] = {}
    for name in sorted(window[0][1]):
        rows = [(t, s[name]) for t, s in window if name in s]
        out[name] = {
            stat: growth(
                [t for t, _ in rows], [r[stat] for _, r in rows], 1 if stat in _COUNTS else 2**20
            )
            for stat in rows[0][1]
            if all(stat in r for _, r in rows)
        }
    return out


async def soak(url: str, pid: int, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The load and the sampler; then the sessions left (load.drain) and the report."""
    import aiohttp

    config = LoadConfig(
        url=url,
        clients=args.clients,
        duration_s=args.duration,
        model=model,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
    )
    records: list[Record] = []
    samples: list[tuple[float, dict[str, Any]]] = []
    replicas: list[tuple[float, dict[str, Any]]] = []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.clients + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        t0 = time.monotonic()
        done = asyncio.Event()

        async def memory() -> None:
            now = await asyncio.to_thread(sample, pid)
            samples.append((round(time.monotonic() - t0, 1), now))
            held = replica_sample(await load.status(http, config))
            replicas.append((round(time.monotonic() - t0, 1), held))

        sampler = asyncio.create_task(every(args.sample_s, done, memory))
        stop_at = t0 + args.duration
        await asyncio.gather(
            *(load.client(http, config, i, t0, stop_at, records) for i in range(args.clients))
        )
        wall = time.monotonic() - t0
        done.set()
        await sampler
        after = await load.drain(http, config)
    ok = [r for r in records if r.status == 200]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": args.duration,
        "wall_s": round(wall, 1),
        "clients": args.clients,
        "sample_s": args.sample_s,
        **memory_report(samples, args.window),
        "replica_growth_after_warmup": replica_report(replicas, args.window),
        "requests": len(records),
        "ok": len(ok),
        "abandoned": sum(1 for r in records if r.status == ABANDONED),
        "errors": dict(Counter(str(r.status) for r in records if r.status not in (200, ABANDONED))),
        "error_examples": [r.error for r in records if r.error][:5],
        "latency_s": percentiles([r.latency_s for r in ok]),
        "sessions_after": after,
        "samples": [{"t": t, **{k: v["rss"] for k, v in s.items()}} for t, s in samples],
        "replica_samples": [{"t": t, **s} for t, s in replicas],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dsbd bench soak`."""
    parser.add_argument("--config", type=Path, help="Serve config (default: embedded SmolLM2)")
    parser.add_argument("--app", help="the application to drive (default: the config's first)")
    parser.add_argument("--url", help="a running server instead (with --pid)")
    parser.add_argument("--pid", type=int, help="the running server's `dsbd serve` process")
    parser.add_argument("--model", help="the served model id (default: the config's)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--window", type=float, default=1200.0, help="seconds measured at the end")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--num-cpus", type=ray_cpus, help="CPUs Ray may schedule on")
    parser.add_argument("--workdir", type=Path, help="server log and ready file (default: tmp)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    trends = parser.add_argument_group("saved soaks side by side (no run)")
    trends.add_argument(
        "--trends",
        nargs="+",
        type=Path,
        metavar="SOAK.json",
        help="print each process's growth by end points and by fitted trend, per saved soak",
    )
    trends.add_argument(
        "--trends-top", type=int, default=3, metavar="N", help="processes shown per soak"
    )
    trends.add_argument("--json", action="store_true", help="--trends: every process, as JSON")


def run(args: argparse.Namespace) -> int:
    """Run `dsbd bench soak` (start a server or drive a running one), or print saved soaks'
    trends with --trends."""
    if args.trends:
        return show_trends(args.trends, top=args.trends_top, as_json=args.json)
    if (args.url is None) != (args.pid is None):
        return fail("--url and --pid go together")
    if args.clients < 1 or args.duration <= 0 or not 0 < args.window <= args.duration:
        return fail("--clients >= 1, --duration > 0 and 0 < --window <= --duration")
    from dsbd import server_process

    server = None
    if args.url is None:
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        workdir = args.workdir or tmp / f"dsbd-soak-{os.getpid()}"
        server = server_process.start(
            workdir, args.config, app_name=args.app, num_cpus=args.num_cpus
        )
        url, pid, model = server.url, server.pid, args.model or server.model
        print(f"dsbd serve at {url} (pid {pid}, log {server.log})", flush=True)
    else:
        url, pid = args.url.rstrip("/"), args.pid
        model = args.model or server_process.application(args.config, args.app)[0].model_name
    try:
        results = asyncio.run(soak(url, pid, model, args))
    finally:
        if server is not None:
            server_process.stop(server)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(server_process.summary(results))
    print(
        json.dumps(
            {k: results[k] for k in ("rss_growth_after_warmup", "rss_total_growth")}, indent=1
        )
    )
    return 0
