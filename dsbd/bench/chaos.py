"""Chaos: N clients against `dsbd serve` for T minutes while replicas are SIGKILLed again and again.

Starts `dsbd serve` itself (loopback only; the embedded SmolLM2 pair, or `--config FILE` and
`--app NAME`), then runs `--clients` clients back to back for `--duration` seconds: the request
mix of `dsbd bench load` (OpenAI and native routes, streams, clients that go away mid-decode
on purpose) plus seeded requests (`adaptive: false`, a seed: a `--seeded-share` of all
requests). 30 to 60 s (`--kill-every`) after the previous replica recovered it SIGKILLs a
Router, Draft or Verifier replica process (`--targets`, each in turn, in an order shuffled once
by `--seed`), its pid read from `/v1/dsbd/status` and checked to be a descendant of the server,
then measures the recovery: the time until the status names a live replica of that deployment
other than the killed one and a small DSBD request (draft and verifier) succeeds. The load runs
`--quiet-tail` seconds past the last recovery at least, and `--kills N` makes N kills however
long that takes (without it, no kill in the last `--quiet-tail` seconds of `--duration`).

Afterwards it stops the server and decodes every seeded request in-process with the same
models, loaded as the replicas load them (`dsbd_core.models.pair.load_pair` with the
application's `ModelOptions`, same dtype and draft variant), and compares the tokens.

A client behaves as the openai client does by default: a request answered with no response,
408, 409, 429 or a 5xx is sent again up to `--client-retries` (2) more times; the report counts
those (`client_retries`, `status_5xx_answered`). A killed Router replica costs its decodes a
hand-over to another router (deployments/decode/client.py); a killed Draft or Verifier replica
costs a retried iteration (`retries`). Neither should cost a request or a client retry.

Reports (`--out`, default benchmarks/results/chaos.json, plus a PNG of latency over time with
the kills marked): requests sent, completed, abandoned on purpose, failed after the client's
retries (by status and cause: which kill the request overlapped), 5xx (final answers, and every
5xx answered), hand-overs (native decodes given to another router: `stats.serving.handovers`),
retries (iterations the server retried: `stats.serving.retries` of native responses; requests
a client sent again), recovery per kill and its maximum, latency p50/p99 before, during and
after the kills, and the seeded comparison (`cache_lost`: those rebuilt by replay). Targets
(issue 21): 0 failed, 0 5xx, seeded equal to in-process tokens, every replica back in 60 s.

    dsbd bench chaos                                                  # 32 x 10 min
    dsbd bench chaos --config serve.yaml --clients 8 --duration 90 --kills 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsbd.bench import load
from dsbd.bench.chaos_report import (
    KILLABLE,
    SIDES,
    ChaosConfig,
    Kill,
    Run,
    compare_seeded,
    plot,
    summarise,
)
from dsbd.bench.load import MIX, LoadConfig, Record, body_for, send
from dsbd.common import fail, ray_cpus

if TYPE_CHECKING:
    import aiohttp

# DSBD: one call to the draft and one to the verifier
PROBE = {
    "prompt_ids": [5, 6, 7],
    "max_new_tokens": 2,
    "width": 2,
    "gamma": 1,
    "seed": 0,
    "adaptive": False,
}


def seeded_body(index: int, max_tokens: int) -> dict[str, Any]:
    """A seeded, fixed-knob DSBD request: token ids valid in any vocabulary of >= 256."""
    prompt = [16 + (index * 7 + k * 13) % 230 for k in range(3 + index % 5)]
    return {
        "prompt_ids": prompt,
        "seed": 1000 + index,
        "max_new_tokens": max_tokens,
        "width": 2 + index % 2,
        "gamma": 2,
        "adaptive": False,
    }


async def native(http: aiohttp.ClientSession, run: Run, kind: str, body: dict[str, Any]) -> Record:
    """A native request; keeps its retries and, for a seeded one, the beams it returned."""
    start = time.monotonic()
    status, error, tokens = 0, None, 0
    try:
        async with http.post(run.url + "/v1/dsbd/generate", json=body) as response:
            status = response.status
            reply = await response.json(content_type=None)
        if status != 200:
            error = json.dumps(reply)[:300]
        else:
            serving = reply["stats"]["serving"]
            retries = serving["retries"]
            run.retries.append(len(retries))
            run.retry_causes += [r.split(": ")[1] if ": " in r else r for r in retries]
            run.handovers.append(len(serving.get("handovers", [])))
            tokens = sum(len(b["token_ids"]) for b in reply["beams"])
            if kind == "seeded/generate":  # a lost cache: an iteration retried, a replica changed
                lost = bool(retries) or any(
                    len(set(serving[side + "_replica"])) > 1 for side in ("verify", "draft")
                )
                run.seeded.append(
                    {
                        "body": body,
                        "cache_lost": lost,
                        "beams": [
                            {"token_ids": b["token_ids"], "log_likelihood": b["log_likelihood"]}
                            for b in reply["beams"]
                        ],
                    }
                )
    except Exception as exc:  # no (complete) response: counted by its type
        error = f"{type(exc).__name__}: {exc}"[:300]
    return Record(kind, start - run.t0, time.monotonic() - start, status, error, tokens)


def retryable(status: int) -> bool:
    """What the openai client retries (`max_retries`, 2 by default): no response or a broken
    body (0, -1 here), 408, 409, 429 and every 5xx."""
    return status in (0, -1, 408, 409, 429) or status >= 500


async def attempt(
    http: aiohttp.ClientSession,
    run: Run,
    config: ChaosConfig,
    load_config: LoadConfig,
    kind: str,
    route: str,
    body: dict[str, Any],
) -> Record:
    """One request as a client sends it: retried like the openai client (up to
    `client_retries` more attempts, back-off 0.5 s doubling); every retried attempt is kept in
    `run.client_retried`, and the record returned spans all attempts. No kill should cost a
    client retry: the ingress hands a killed router's decodes to another router, and the
    router retries an iteration a draft or verifier took with it."""
    first = time.monotonic()
    for tries in range(config.client_retries + 1):
        if route.endswith("/generate"):
            record = await native(http, run, kind, body)
        else:
            record = await send(http, load_config, kind, route, body, run.t0)
        if not retryable(record.status) or tries == config.client_retries:
            break
        run.client_retried.append(record)
        await asyncio.sleep(0.5 * 2**tries)
    record.start_s = round(first - run.t0, 3)
    record.latency_s = time.monotonic() - first
    return record


async def client(
    http: aiohttp.ClientSession,
    run: Run,
    config: ChaosConfig,
    load_config: LoadConfig,
    index: int,
) -> None:
    rng = random.Random(config.seed * 1000 + index)
    round_ = 0
    while time.monotonic() < run.stop_at:
        number = index + round_ * config.clients  # every request of the run has its own seed
        if rng.random() < config.seeded_share:
            kind, route = "seeded/generate", "/v1/dsbd/generate"
            body = seeded_body(number, config.max_tokens)
        else:
            kind, route, extras = MIX[(index + round_) % len(MIX)]
            body = body_for(load_config, route, extras, number)
        run.records.append(await attempt(http, run, config, load_config, kind, route, body))
        round_ += 1


async def status(http: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(15):
            async with http.get(url + "/v1/dsbd/status") as response:
                if response.status == 200:
                    return await response.json()
    return None


def pid_of(state: dict[str, Any], side: str) -> int | None:
    """The side's replica pid in a status, None while it does not answer (being replaced)."""
    pid = state[side]["pid"]
    return None if pid is None else int(pid)


def gcs_pid(server_pid: int) -> int | None:
    """Ray's GCS process among the server's descendants (None while there is none)."""
    from dsbd import server_process

    found = [
        pid
        for pid, title in server_process.descendants(server_pid).items()
        if title.split()[0].endswith("/gcs_server")
    ]
    return found[0] if len(found) == 1 else None


def gcs_listening(pid: int) -> bool:
    """Whether the GCS process listens (it binds its port once its tables are read back)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return any(c.status == "LISTEN" for c in psutil.Process(pid).net_connections())
    return False


async def kill_one(http: aiohttp.ClientSession, run: Run, side: str) -> Kill | None:
    """SIGKILL the `side` replica the status names, or the GCS (a descendant of our server
    only)."""
    from dsbd import server_process

    if side == "gcs":
        pid = gcs_pid(run.server_pid)
        if pid is None:
            return None
    else:
        state = await status(http, run.url)
        if state is None:
            return None
        pid = pid_of(state, side)
        if pid is None:
            return None
        if pid not in server_process.descendants(run.server_pid):
            raise RuntimeError(f"{side} pid {pid} is not a process of the server we started")
    os.kill(pid, signal.SIGKILL)
    return Kill(side, pid, round(run.now(), 2))


def replacement(run: Run, kill: Kill, state: dict[str, Any] | None) -> int | None:
    """The live process that took the killed one's place, if any yet: a replica the status
    names, or a GCS that listens again (then `kill.outage_s` is set)."""
    from dsbd import server_process

    if kill.side == "gcs":
        pid = gcs_pid(run.server_pid)
        if pid is None or pid == kill.pid or not gcs_listening(pid):
            return None
        kill.outage_s = round(run.now() - kill.at_s, 2)
        return pid
    pid = pid_of(state, kill.side) if state else None
    alive = set(server_process.descendants(run.server_pid))
    return pid if pid is not None and pid != kill.pid and pid in alive else None


async def recover(http: aiohttp.ClientSession, run: Run, kill: Kill, timeout_s: float) -> None:
    """Wait until a live replica of the killed deployment (not the killed pid) answers in the
    status, or a new GCS listens, and a probe request through draft and verifier succeeds."""
    deadline = time.monotonic() + timeout_s
    replaced = False
    while time.monotonic() < deadline:
        if not replaced:
            state = None if kill.side == "gcs" else await status(http, run.url)
            kill.new_pid = replacement(run, kill, state)
            replaced = kill.new_pid is not None
        if replaced:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                    async with http.post(run.url + "/v1/dsbd/generate", json=PROBE) as response:
                        kill.probe_status = response.status
                        await response.read()
                if kill.probe_status == 200:
                    kill.recovered_s = round(run.now() - kill.at_s, 2)
                    return
        await asyncio.sleep(0.25)


async def killer(http: aiohttp.ClientSession, run: Run, config: ChaosConfig) -> None:
    """Kills timed from recoveries (module docstring): each outage is followed by load."""
    rng = random.Random(config.seed)
    order = rng.sample(config.targets, len(config.targets))  # each side in turn, shuffled once
    low, high = config.kill_every_s
    next_at = config.first_kill_s if config.first_kill_s is not None else rng.uniform(low, high)
    last_allowed = config.duration_s - config.quiet_tail_s
    while (
        len(run.kills) < config.max_kills
        if config.max_kills is not None
        else next_at <= last_allowed
    ):
        run.stop_at = max(run.stop_at, run.t0 + next_at + 1.0)  # load runs through the kill
        await asyncio.sleep(max(0.0, next_at - run.now()))
        kill = await kill_one(http, run, order[len(run.kills) % len(order)])
        if kill is None:  # no status now (a router down): try again shortly
            next_at = run.now() + 2
            continue
        run.kills.append(kill)
        print(f"[{kill.at_s:7.1f} s] SIGKILL {kill.side} pid {kill.pid}", flush=True)
        await recover(http, run, kill, config.recovery_timeout_s)
        print(
            f"[{run.now():7.1f} s] {kill.side} recovered after {kill.recovered_s} s "
            f"(new pid {kill.new_pid})",
            flush=True,
        )
        run.stop_at = max(run.stop_at, time.monotonic() + config.quiet_tail_s)
        next_at = run.now() + rng.uniform(low, high)


async def drive(run: Run, config: ChaosConfig) -> dict[str, Any]:
    """The clients and the killer; then the sessions left (load.drain)."""
    import aiohttp

    load_config = LoadConfig(
        url=run.url,
        clients=config.clients,
        duration_s=config.duration_s,
        model=run.model,
        max_tokens=config.max_tokens,
        request_timeout_s=config.request_timeout_s,
    )
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.clients + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with http.post(run.url + "/v1/dsbd/generate", json=PROBE) as response:
            assert response.status == 200, await response.text()  # warm, and the app works
        run.t0 = time.monotonic()
        run.stop_at = run.t0 + config.duration_s
        kills = asyncio.create_task(killer(http, run, config))
        await asyncio.gather(
            *(client(http, run, config, load_config, i) for i in range(config.clients))
        )
        wall = run.now()
        await kills
        return {"wall_s": round(wall, 2), "sessions_after": await load.drain(http, load_config)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dsbd bench chaos`."""
    parser.add_argument("--config", type=Path, help="Serve config (default: embedded SmolLM2)")
    parser.add_argument("--app", help="the application to drive (default: the config's first)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--kill-every",
        type=float,
        nargs=2,
        default=(30.0, 60.0),
        metavar=("MIN", "MAX"),
        help="seconds from a recovery to the next kill",
    )
    parser.add_argument("--first-kill", type=float, help="seconds to the first kill")
    parser.add_argument("--quiet-tail", type=float, default=60.0, help="load after the last kill")
    parser.add_argument("--kills", type=int, help="this many kills (the run lasts for them)")
    parser.add_argument(
        "--targets",
        "--kill",
        dest="targets",
        default=",".join(SIDES),
        help=f"what may be killed, in turn: a comma list of {', '.join(KILLABLE)} (default: the "
        "three replica sides); with gcs the server keeps Ray's GCS tables in a Redis this "
        "bench starts on loopback (dsbd serve --gcs-redis), which needs redis-server",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seeded-share", type=float, default=0.25)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--recovery-timeout", type=float, default=180.0)
    parser.add_argument(
        "--client-retries",
        type=int,
        default=2,
        help="attempts added after 0/408/409/429/5xx, as openai",
    )
    parser.add_argument("--num-cpus", type=ray_cpus, help="CPUs Ray may schedule on")
    parser.add_argument("--strace", type=Path, help="run the server under strace -f, into DIR")
    parser.add_argument("--workdir", type=Path, help="server log and ready file (default: tmp)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chaos.json"))
    parser.add_argument("--no-compare", action="store_true", help="skip the in-process check")


def chaos_config(args: argparse.Namespace) -> ChaosConfig:
    """The run's settings from the flags (ValueError naming the flag for a value out of range)."""
    targets = tuple(args.targets.split(","))
    if not set(targets) <= set(KILLABLE) or not targets:
        raise ValueError(f"--targets={args.targets}: allowed a comma list of {', '.join(KILLABLE)}")
    if args.clients < 1 or args.duration <= 0 or not 0 < args.kill_every[0] <= args.kill_every[1]:
        raise ValueError("--clients >= 1, --duration > 0 and 0 < --kill-every MIN <= MAX")
    if args.client_retries < 0:
        raise ValueError(f"--client-retries={args.client_retries}: allowed >= 0")
    if not 0 <= args.seeded_share <= 1:
        raise ValueError(f"--seeded-share={args.seeded_share}: allowed 0..1")
    return ChaosConfig(
        clients=args.clients,
        duration_s=args.duration,
        kill_every_s=tuple(args.kill_every),
        first_kill_s=args.first_kill,
        quiet_tail_s=args.quiet_tail,
        max_kills=args.kills,
        targets=targets,
        seed=args.seed,
        max_tokens=args.max_tokens,
        seeded_share=args.seeded_share,
        request_timeout_s=args.request_timeout,
        recovery_timeout_s=args.recovery_timeout,
        client_retries=args.client_retries,
    )


def run(args: argparse.Namespace) -> int:
    """Run `dsbd bench chaos`: start the server, load it, kill replicas, compare, report."""
    from dsbd import server_process

    try:
        config = chaos_config(args)
    except ValueError as error:
        return fail(str(error))
    workdir = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"dsbd-chaos-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        env = None
        if "gcs" in config.targets:  # the GCS's tables in a Redis, so that it can come back
            from deployments.gcs_ft import PASSWORD_ENV
            from dsbd.bench.local_redis import local_redis

            redis = stack.enter_context(local_redis(workdir / "redis"))
            env = {"DSBD_GCS_REDIS": redis.address, PASSWORD_ENV: redis.password}
        server = server_process.start(
            workdir,
            args.config,
            app_name=args.app,
            num_cpus=args.num_cpus,
            strace_dir=args.strace,
            env=env,
        )
        print(f"dsbd serve at {server.url} (pid {server.pid}, log {server.log})", flush=True)
        chaos = Run(server.url, server.model, server.pid)
        try:
            extra = asyncio.run(drive(chaos, config))
        finally:
            extra_left = server_process.stop(server)
    extra["server_leftover_processes"] = extra_left
    extra["seeded"] = (
        {"compared": 0, "why": "--no-compare"}
        if args.no_compare
        else compare_seeded(server.app, chaos.seeded)
    )
    results = summarise(chaos, config, extra)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(server_process.summary(results))
    print(
        json.dumps(
            {
                k: results[k]
                for k in ("failed_by_status", "failed_causes", "kill_log", "latency_s", "seeded")
            },
            indent=1,
        )
    )
    return 0
