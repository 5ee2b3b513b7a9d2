"""Load test: N concurrent clients for T seconds against a running dsbd server, over loopback.

Each client sends requests back to back, cycling through a mix of routes and methods (OpenAI
completions, chat, chat streamed, native generate; dsbd, beam, sps, sample), until the run's
time is up; requests still in flight then finish (bounded by `--request-timeout`). Meanwhile a
sampler records every `--sample-s` the resident memory of the server's whole process tree
(`--pid`: the `dsbd serve` process; Ray's processes are its descendants) and the session counts
of `/v1/dsbd/status`. Afterwards it waits for the sessions to drain and writes one JSON:
latency percentiles (p50/p90/p99, overall and per kind), errors by status, throughput, memory
over time with its growth after warm-up, and the session counts left.

    dsbd bench load --url http://127.0.0.1:8000 --pid PID --clients 64 --duration 60 \
        --model smollm2 --max-tokens 8 --out benchmarks/results/load_smollm2.json

Why a process-tree sum: Ray runs the proxy, router and each replica as separate processes; a leak
in any of them shows in the sum. RSS counts the pages each process maps, shared ones (Ray's
object store) once per process that touched them, so PSS (shared pages divided among their
users) is recorded as well; both are reported, the flatness check uses RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from dsbd.common import fail

if TYPE_CHECKING:
    import aiohttp

# (kind, route, body extras): the request mix, cycled by every client from its own offset.
# `abandon` kinds are clients that go away mid-decode (a client-side time-out of a plain
# request; a stream closed after its first event): they exercise the cancellation path under
# load, and the sessions must still drain to 0 afterwards.
MIX: list[tuple[str, str, dict[str, Any]]] = [
    ("completions/dsbd", "/v1/completions", {"width": 2, "gamma": 2, "n": 2}),
    ("chat/beam", "/v1/chat/completions", {"method": "beam", "width": 2}),
    ("chat-stream/sps", "/v1/chat/completions", {"method": "sps", "gamma": 2, "stream": True}),
    ("generate/dsbd", "/v1/dsbd/generate", {"width": 2, "gamma": 2, "threshold": 0.7}),
    ("abandon/completions", "/v1/completions", {"width": 2, "gamma": 2, "max_tokens": 200}),
    ("completions-stream/dsbd", "/v1/completions", {"width": 2, "gamma": 1, "stream": True}),
    ("completions/sample", "/v1/completions", {"method": "sample"}),
    (
        "abandon-stream/chat",
        "/v1/chat/completions",
        {"method": "beam", "width": 2, "max_tokens": 200, "stream": True},
    ),
]
ABANDONED = -2  # the status recorded for a request its client gave up on as planned
PROMPTS = [
    "What is the capital of France?",
    "one two three four",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "def fib(n):",
    "List three prime numbers.",
]


@dataclass
class LoadConfig:
    """One load run."""

    url: str
    clients: int = 64
    duration_s: float = 60.0
    model: str = "smollm2"
    max_tokens: int = 8
    pid: int | None = None  # the server's root process (memory sampling); None: not sampled
    api_key: str | None = None
    sample_s: float = 1.0
    warmup_fraction: float = 0.25  # memory before this share of the run is warm-up
    request_timeout_s: float = 120.0
    settle_s: float = 60.0  # how long to wait for the sessions to drain afterwards
    abandon: bool = True  # include the clients that go away mid-decode
    abandon_after_s: float = 0.3  # when a plain request's client gives up


@dataclass
class Record:
    kind: str
    start_s: float
    latency_s: float
    status: int  # HTTP status; 0 = no response (connection error, time-out)
    error: str | None = None
    tokens: int = 0


@dataclass
class Samples:
    time_s: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    pss_bytes: list[int] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    # (time, open sessions, verifier cached sessions, draft cached sessions)
    sessions: list[tuple[float, int, int, int]] = field(default_factory=list)
    by_process: list[dict[str, int]] = field(default_factory=list)  # RSS per process, per sample


def tree_memory(pid: int) -> tuple[int, int, dict[str, int]]:
    """(RSS, PSS) summed over `pid` and all its descendants, and RSS by process
    ("name pid": Ray names its actors' processes `ray::ServeReplica:app:Deployment`)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, {}
    rss = pss = 0
    by_process = {}
    for process in processes:
        try:
            info = process.memory_full_info()
            # Ray retitles a worker with the method it runs ("ray::Router.handle_request"):
            # keep the class part so a process keeps its name from sample to sample
            name = (process.cmdline() or [process.name()])[0].split("/")[-1].split(".")[0]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
        by_process[f"{name} {process.pid}"] = info.rss
    return rss, pss, by_process


def body_for(config: LoadConfig, route: str, extras: dict[str, Any], i: int) -> dict[str, Any]:
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict[str, Any] = {"seed": i, **extras}
    if route.endswith("/generate"):
        return {**body, "prompt": prompt, "chat": True, "max_new_tokens": config.max_tokens}
    body = {"model": config.model, "max_tokens": config.max_tokens, **body}
    if route.endswith("/chat/completions"):
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def send(
    http: aiohttp.ClientSession,
    config: LoadConfig,
    kind: str,
    route: str,
    body: dict[str, Any],
    t0: float,
) -> Record:
    """One request; a stream counts as an error unless it ends with [DONE] and no error event."""
    start = time.monotonic()
    status, error, tokens = 0, None, 0
    if kind.startswith("abandon"):
        status, error = await abandon(http, config, route, body)
        return Record(kind, start - t0, time.monotonic() - start, status, error)
    try:
        async with http.post(config.url + route, json=body) as response:
            status = response.status
            if body.get("stream"):
                text = await response.text()
                events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
                if status == 200 and (not events or events[-1] != "[DONE]"):
                    error = f"stream ended without [DONE]: {text[-300:]}"
                elif status == 200 and any("error" in json.loads(e) for e in events[:-1]):
                    error = f"error event in stream: {text[-300:]}"
                tokens = sum(1 for e in events if '"text"' in e or '"content"' in e)
            else:
                reply = await response.json(content_type=None)
                if status != 200:
                    error = json.dumps(reply)[:300]
                elif "usage" in reply:
                    tokens = int(reply["usage"]["completion_tokens"])
                else:
                    tokens = sum(len(b["token_ids"]) for b in reply["beams"])
    except Exception as exc:  # no (complete) response: counted by its type
        error = f"{type(exc).__name__}: {exc}"[:300]
    if error is not None and status == 200:
        status = -1  # a 200 whose body was wrong
    return Record(kind, start - t0, time.monotonic() - start, status, error, tokens)


async def abandon(
    http: aiohttp.ClientSession, config: LoadConfig, route: str, body: dict[str, Any]
) -> tuple[int, str | None]:
    """Start a long decode and go away: a stream after its first event, a plain request after
    `abandon_after_s` (the connection is closed either way). An answer that comes first
    counts as itself (200 or an error)."""
    try:
        if body.get("stream"):
            async with http.post(config.url + route, json=body) as response:
                if response.status != 200:
                    return response.status, (await response.text())[:300]
                await response.content.readline()
                response.close()  # drops the connection mid-stream
                return ABANDONED, None
        try:
            async with asyncio.timeout(config.abandon_after_s):
                async with http.post(config.url + route, json=body) as response:
                    reply = await response.text()
                    return response.status, None if response.status == 200 else reply[:300]
        except TimeoutError:
            return ABANDONED, None
    except Exception as exc:
        return 0, f"{type(exc).__name__}: {exc}"[:300]


async def client(
    http: aiohttp.ClientSession,
    config: LoadConfig,
    index: int,
    t0: float,
    stop_at: float,
    records: list[Record],
) -> None:
    mix = [m for m in MIX if config.abandon or not m[0].startswith("abandon")]
    round_ = 0
    while time.monotonic() < stop_at:
        kind, route, extras = mix[(index + round_) % len(mix)]
        seed = index + round_ * config.clients  # every request of the run has its own seed
        body = body_for(config, route, extras, seed)
        records.append(await send(http, config, kind, route, body, t0))
        round_ += 1


async def status(http: aiohttp.ClientSession, config: LoadConfig) -> dict[str, Any] | None:
    try:
        async with http.get(config.url + "/v1/dsbd/status") as response:
            return await response.json() if response.status == 200 else None
    except Exception:
        return None


async def every(period_s: float, done: asyncio.Event, sample: Any) -> None:
    """Call `await sample()` every `period_s` until `done` (a slow sample delays only itself)."""
    while not done.is_set():
        started = time.monotonic()
        await sample()
        left = period_s - (time.monotonic() - started)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=max(0.0, left))


def sampler(
    http: aiohttp.ClientSession,
    config: LoadConfig,
    t0: float,
    samples: Samples,
    done: asyncio.Event,
) -> list[Any]:
    """Two loops: the process tree's memory (local, cheap) and the server's session counts (an
    HTTP call that waits its turn behind the load, so it is sampled separately)."""

    async def memory() -> None:
        assert config.pid is not None  # sampled only then (below)
        rss, pss, by_process = await asyncio.to_thread(tree_memory, config.pid)
        samples.time_s.append(round(time.monotonic() - t0, 2))
        samples.rss_bytes.append(rss)
        samples.pss_bytes.append(pss)
        samples.processes.append(len(by_process))
        samples.by_process.append(by_process)

    async def sessions() -> None:
        now = round(time.monotonic() - t0, 2)
        state = await status(http, config)
        if state is not None:
            samples.sessions.append(
                (
                    now,
                    state["open_sessions"],
                    state["verifier"]["cached_sessions"],
                    state["draft"]["cached_sessions"],
                )
            )

    loops = [every(config.sample_s, done, sessions)]
    if config.pid is not None:
        loops.append(every(config.sample_s, done, memory))
    return loops


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {
        "p50": at(0.50),
        "p90": at(0.90),
        "p99": at(0.99),
        "max": round(ordered[-1], 4),
        "mean": round(statistics.fmean(ordered), 4),
    }


def memory_summary(samples: Samples, config: LoadConfig) -> dict[str, Any]:
    """Growth of the tree's memory after warm-up, relative to the first sample after it."""
    warm = config.warmup_fraction * config.duration_s
    after = [i for i, t in enumerate(samples.time_s) if warm <= t <= config.duration_s]
    if config.pid is None or not after:
        return {"sampled": False}
    out: dict[str, Any] = {"sampled": True, "warmup_s": warm}
    for name, series in (("rss", samples.rss_bytes), ("pss", samples.pss_bytes)):
        values = [series[i] for i in after]
        base = values[0]
        out[name] = {
            "after_warmup_first_mib": round(base / 2**20, 1),
            "after_warmup_min_mib": round(min(values) / 2**20, 1),
            "after_warmup_max_mib": round(max(values) / 2**20, 1),
            "last_mib": round(values[-1] / 2**20, 1),
            # the band the series stays in, relative to its first post-warm-up value
            "max_growth": round(max(values) / base - 1, 4),
            "max_drop": round(1 - min(values) / base, 4),
        }
    # Where the memory went. A process that starts after warm-up (Serve autoscaling a
    # deployment up: a new replica) is new memory, not growth of the ones that ran already.
    first, last = samples.by_process[after[0]], samples.by_process[after[-1]]
    growth = {k: last[k] - first[k] for k in first.keys() & last.keys()}

    def mib(items: dict[str, int]) -> dict[str, float]:
        ordered = sorted(items.items(), key=lambda kv: -abs(kv[1]))[:8]
        return {k: round(v / 2**20, 1) for k, v in ordered}

    same = [sum(samples.by_process[i].get(k, 0) for k in first) for i in after]
    out["rss_same_processes"] = {  # the processes running at the end of warm-up only
        "max_growth": round(max(same) / same[0] - 1, 4),
        "max_drop": round(1 - min(same) / same[0], 4),
    }
    out["rss_growth_by_process_mib"] = mib(growth)
    started = {k: last[k] for k in last.keys() - first.keys()}
    out["processes_started_after_warmup_mib"] = mib(started)
    out["processes_gone_after_warmup"] = sorted(first.keys() - last.keys())
    return out


async def drain(http: aiohttp.ClientSession, config: LoadConfig) -> dict[str, Any]:
    """Wait until no session is open or cached anywhere (up to `settle_s`)."""
    start = time.monotonic()
    state = None
    while time.monotonic() - start < config.settle_s:
        state = await status(http, config)
        if (
            state
            and state["open_sessions"] == 0
            and state["verifier"]["cached_sessions"] == 0
            and state["draft"]["cached_sessions"] == 0
        ):
            break
        await asyncio.sleep(0.5)
    return {
        "open_sessions": state["open_sessions"] if state else None,
        "verifier_cached_sessions": state["verifier"]["cached_sessions"] if state else None,
        "draft_cached_sessions": state["draft"]["cached_sessions"] if state else None,
        "drained_after_s": round(time.monotonic() - start, 2),
    }


async def run_load(config: LoadConfig) -> dict[str, Any]:
    """Drive the load; returns the results (see the module docstring)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.clients + 4)
    records: list[Record] = []
    samples = Samples()
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as http:
        t0 = time.monotonic()
        stop_at = t0 + config.duration_s
        done = asyncio.Event()
        sampling = [asyncio.create_task(loop) for loop in sampler(http, config, t0, samples, done)]
        await asyncio.gather(
            *(client(http, config, i, t0, stop_at, records) for i in range(config.clients))
        )
        wall = time.monotonic() - t0
        done.set()
        await asyncio.gather(*sampling)
        after = await drain(http, config)
    ok = [r for r in records if r.status == 200]
    errors = Counter(str(r.status) for r in records if r.status not in (200, ABANDONED))
    kinds = sorted({r.kind for r in records})
    return {
        "config": asdict(config) | {"api_key": bool(config.api_key)},
        "machine": {
            "platform": platform.platform(),
            "cpus": psutil.cpu_count(),
            "python": sys.version.split()[0],
        },
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(wall, 2),
        "requests": len(records),
        "ok": len(ok),
        "abandoned": sum(1 for r in records if r.status == ABANDONED),
        "errors": dict(errors),
        "error_examples": [r.error for r in records if r.error][:5],
        "throughput_rps": round(len(ok) / wall, 2),
        "tokens_per_s": round(sum(r.tokens for r in ok) / wall, 1),
        "latency_s": percentiles([r.latency_s for r in ok]),
        "latency_by_kind_s": {
            k: percentiles([r.latency_s for r in ok if r.kind == k])
            for k in kinds
            if not k.startswith("abandon")
        },
        "memory": memory_summary(samples, config),
        "sessions_after": after,
        # per-process RSS is summarised in "memory" (rss_growth_by_process_mib)
        "samples": {k: v for k, v in asdict(samples).items() if k != "by_process"},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dsbd bench load`."""
    parser.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--model", default="smollm2", help="the served model id")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pid", type=int, help="the server's root process (memory sampling)")
    parser.add_argument("--api-key", help="sent as a Bearer token (default: none)")
    parser.add_argument("--warmup-fraction", type=float, default=0.25)
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--settle", type=float, default=60.0)
    parser.add_argument(
        "--no-abandon", action="store_true", help="leave out the clients that go away mid-decode"
    )
    parser.add_argument(
        "--abandon-after",
        type=float,
        default=0.3,
        help="seconds before a plain request's client gives up",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")


def run(args: argparse.Namespace) -> int:
    """Run `dsbd bench load`: the load, then one JSON of results at --out."""
    if args.clients < 1 or args.duration <= 0:
        return fail(f"--clients={args.clients} --duration={args.duration}: both must be > 0")
    config = LoadConfig(
        url=args.url.rstrip("/"),
        clients=args.clients,
        duration_s=args.duration,
        model=args.model,
        max_tokens=args.max_tokens,
        pid=args.pid,
        api_key=args.api_key,
        sample_s=args.sample_s,
        warmup_fraction=args.warmup_fraction,
        request_timeout_s=args.request_timeout,
        settle_s=args.settle,
        abandon=not args.no_abandon,
        abandon_after_s=args.abandon_after,
    )
    results = asyncio.run(run_load(config))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    memory = results["memory"]
    print(
        f"{results['requests']} requests in {results['wall_s']} s, {results['ok']} ok, "
        f"errors {results['errors'] or 0}; {results['throughput_rps']} req/s; latency "
        f"{results['latency_s']}; memory after warm-up: {memory.get('rss', 'not sampled')}; "
        f"sessions after: {results['sessions_after']}"
    )
    return 0
