"""`dsbd serve` as a child process: the one launcher the tests and the benchmarks share
(tests/support/serving_harness.py; `dsbd bench chaos` kills its processes, `dsbd bench soak` samples
them for half an hour, `dsbd bench serve` times requests through it: dsbd/bench/).

The server is started the way users start it (`dsbd serve [--config FILE]`), bound to
127.0.0.1 (Ray on loopback only: deployments/local_ray.py), in a session of its own, optionally
under `strace -f` so that a test can check afterwards that nothing but loopback was contacted.
It is stopped with SIGINT to the `dsbd serve` process (or another signal), and whatever of its
session is left behind is killed and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from deployments.app import AppArgs

REPO = Path(__file__).resolve().parent.parent


class ServerStartError(RuntimeError):
    """`dsbd serve` exited or did not get ready in time (the message ends with its log)."""


@dataclass
class Server:
    """A running `dsbd serve`: where it answers and the processes it is made of."""

    process: subprocess.Popen
    url: str  # the application's root: server URL + the application's route prefix
    base_url: str  # the server's URL (http://127.0.0.1:PORT)
    pid: int  # the `dsbd serve` process (Ray's processes are its descendants)
    log: Path
    app: AppArgs  # the arguments of the application under test
    model: str
    ready: dict[str, Any] = field(default_factory=dict)  # what `--ready-file` said (metrics_url)


def application(config: Path | None, name: str | None) -> tuple[AppArgs, str]:
    """The AppArgs and route prefix of application `name` of a Serve config (default: its
    first application; no config: the embedded SmolLM2 pair at /)."""
    if config is None:
        return AppArgs(), ""
    apps = (yaml.safe_load(config.read_text()) or {}).get("applications") or []
    chosen = [a for a in apps if name is None or a.get("name") == name]
    if not chosen:
        raise SystemExit(
            f"--config {config}: no application {name!r}; it has {[a.get('name') for a in apps]}"
        )
    prefix = (chosen[0].get("route_prefix") or "/").rstrip("/")
    return AppArgs.model_validate(chosen[0].get("args") or {}), prefix


# Ports the kernel never hands out by itself (below its ephemeral range) and Ray never takes:
# its workers listen on 10002-19999, its other processes on ephemeral ports or fixed ones below.
_CHOSEN_PORTS = (20000, 32767)


def free_port() -> int:
    """A loopback port nothing listens on now, below the kernel's ephemeral range: a port that
    `bind(0)` picked could be handed to another process (a Ray process of a server starting
    beside, an outgoing connection) before the server that was given it binds it (its Serve
    proxy then fails: "Failed to bind to address")."""
    low, high = _CHOSEN_PORTS
    with contextlib.suppress(OSError, ValueError):
        ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        high = min(high, int(ephemeral[0]) - 1)
    for _ in range(200):
        port = random.randint(low, high) if high > low else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free loopback port in {low}-{high}")


def start(
    workdir: Path,
    config: Path | None = None,
    *,
    app_name: str | None = None,
    num_cpus: int | None = None,
    strace_dir: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
    port: int | None = None,
    exit_on_sigterm: bool = True,
) -> Server:
    """Start `dsbd serve` on `port` (default: a free loopback port) and wait until every
    application runs; `strace_dir`: trace it there where strace is installed.

    The server runs in a session of its own (so its Ray processes can be killed as one), so a
    SIGTERM to the caller (`kill`, `timeout`) would not reach it: with `exit_on_sigterm` the
    caller's SIGTERM is turned into SystemExit, whose `finally: stop(server)` takes the server
    down with it. Raises ServerStartError if it exits or is not ready within `timeout_s`."""
    if exit_on_sigterm:
        _exit_on_sigterm()
    app, prefix = application(config, app_name)
    workdir.mkdir(parents=True, exist_ok=True)
    port, ready = port or free_port(), workdir / "ready"
    ready.unlink(missing_ok=True)
    command = [
        str(REPO / ".venv/bin/dsbd"),
        "serve",
        "--port",
        str(port),
        "--ready-file",
        str(ready),
    ]
    if not Path(command[0]).exists():
        command[0:1] = [sys.executable, "-m", "dsbd"]
    if config is not None:
        command += ["--config", str(config)]
    if num_cpus is not None:
        command += ["--num-cpus", str(num_cpus)]
    if strace_dir is not None and shutil.which("strace"):
        strace_dir.mkdir(parents=True, exist_ok=True)
        command = strace_prefix(strace_dir) + command
    log = workdir / "server.log"
    process = subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            raise ServerStartError(f"dsbd serve did not start:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError, json.JSONDecodeError):
            info = json.loads(ready.read_text())
            break
        time.sleep(1)
    url = info["url"]
    return Server(process, url + prefix, url, int(info["pid"]), log, app, app.model_name, info)


def strace_prefix(trace_dir: Path) -> list[str]:
    """The command prefix that records every connect()/sendto()/sendmsg() of a process tree,
    one file per thread in `trace_dir`.

    `set_robust_list` is traced too, though no check reads it, because every new thread calls
    it first: strace 6.1's --seccomp-bpf stops a thread at each of its system calls until its
    first traced one, so without it a thread that never sends (Ray's and Serve's worker
    threads) is stopped at every call and a traced server uses twice the CPU (the tests'
    22-replica server starts in 232 s traced without it, 143 s with it, 122 s untraced;
    docs/ARCHITECTURE.md, "Tests")."""
    syscalls = ["-e", "trace=connect,sendto,sendmsg,set_robust_list"]
    return ["strace", "-f", "-ff", "-qq", "--seccomp-bpf", *syscalls, "-o", str(trace_dir / "t")]


def _exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, if nobody else handles SIGTERM."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, leave)


def stop(server: Server, signum: int = signal.SIGINT, wait_s: float = 90.0) -> list[int]:
    """`signum` to `dsbd serve` itself (strace, when it leads the session, would only detach),
    then as `end` does; returns the pids that were left behind (and killed)."""
    return end(server.process, lambda: os.kill(server.pid, signum), wait_s)


def end(
    process: subprocess.Popen, interrupt: Callable[[], None], wait_s: float = 90.0
) -> list[int]:
    """Interrupt a process that leads its session, SIGKILL the session if the process outlives
    `wait_s`, then kill and return whatever of the session is still alive."""
    with contextlib.suppress(ProcessLookupError):
        interrupt()
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return leftovers(process.pid)


def leftovers(session: int, wait_s: float = 30.0) -> list[int]:
    """Processes still alive in a session after its leader exited (given `wait_s` to exit,
    then killed)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True)
        left = [int(x) for x in found.stdout.split()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def descendants(pid: int) -> dict[int, str]:
    """pid -> process title of every descendant of `pid` (Ray retitles its workers, e.g.
    `ray::SERVE_REPLICA::dsbd#Verifier#...`); {} when `pid` is gone."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for child in children:
        with contextlib.suppress(psutil.Error):
            out[child.pid] = " ".join(child.cmdline()) or child.name()
    return out


def process_name(title: str) -> str:
    """A stable short name for a process title: the deployment for a Serve replica
    (`dsbd:Verifier`), the class of another Ray actor, else the executable's name."""
    head = title.split()[0] if title else "?"
    if "ServeReplica:" in title:
        word = title.split("ServeReplica:")[1].split()[0]  # Ray pads its titles with spaces
        return ":".join(word.split(".")[0].split(":")[:2])
    if head.startswith("ray::"):
        return head.split(".")[0]
    return head.split("/")[-1]


def summary(results: dict[str, Any]) -> str:
    """One line of the figures a reader wants first (scripts print it at the end)."""
    keys = [k for k in results if not isinstance(results[k], (dict, list))]
    return ", ".join(f"{k}={results[k]}" for k in keys)
