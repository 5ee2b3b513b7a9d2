"""The shared test server and the helpers its tests share (no tests here).

`running_server` starts `dsbd serve --config FILE` with `write_config`'s six applications on tiny
float64 models, under `strace -f` when strace exists, and stops it with SIGINT, checking nothing was
left running; tests/conftest.py's `served` runs it once for the modules that share it
(tests/serving/test_faults.py, test_lm_eval.py, test_serving.py, test_serving_api.py and the
others that ask for `served`). `stop`, `leftovers` and `free_port` are also used by other server
tests.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
import yaml

from deployments import faults
from dsbd import server_process
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.methods import METHODS_WITH_DRAFT
from dsbd_core.models import load_causal_lm, load_tokenizer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.loopback import is_loopback, peers

from .tiny_models import build_pair, build_wide

REPO = Path(__file__).parents[2]
MODEL = "tiny"
API_KEY = "sk-test-7f3a9"
GUARD = {
    "max_prompt_tokens": 24,
    "max_new_tokens": 240,
    "max_width": 4,
    "max_gamma": 3,
    "max_n": 2,
    "max_concurrent_sessions": 2,
    "request_timeout_s": 1.5,
}

# This process's own connections (the server's are traced with strace): the last test of
# tests/serving/test_serving.py checks that all of them went to loopback.
_connections: list[Any] = []


# Serve's health checks every second: a lost replica (or TP rank) is replaced in seconds.
QUICK_HEALTH_CHECKS = {"health_check_period_s": 1, "health_check_timeout_s": 20}

# The shared server's metrics recorded as calls happen instead of flushed every 0.1 s by a loop
# in every replica and handle (Serve's `RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`, 0: no loop). Its
# 30 replicas idle through most of its tests; a one-application server's five idled on 2.6-3.3
# CPU-s a minute against 3.3-4.0 (2 interleaved rounds on the 2-core AMD EPYC;
# benchmarks/results/suite_time_epyc.json, "metrics_export_idle"). No test of this server reads
# Serve's own metrics; `dsbd serve` itself keeps Serve's default.
SHARED_SERVER_ENV = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "0"}


def _audit(event: str, args: tuple) -> None:
    if event == "socket.connect":
        _connections.append(args[1])


sys.addaudithook(_audit)

# The decodes the distributed path is compared on with the in-process engine.
CASES = [
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.6}),
    (
        "dsbd",
        {"width": 2, "draft_width": 3, "gamma": 2, "threshold": None, "mode": "with_replacement"},
    ),
    ("dsbd", {"width": 3, "gamma": 2, "lean_memory": True}),
    ("beam", {"width": 3}),
    ("sps", {"gamma": 4}),
]


MEMORY_BUDGET = 400 * 2**20  # session_memory_bytes of the /memory application's replicas


def armed_faults(root: Path, app: str) -> dict[str, Any]:
    """The runtime_env with which tests/serving/test_faults.py arms a fault in application `app`
    while it runs: deployments/faults.py reads the list from `root/armed-APP` at every counted
    call (empty: off), and each fault fires once per run (its claim in `root/claims-APP`)."""
    (root / f"claims-{app}").mkdir()
    (root / f"armed-{app}").write_text("")
    return {
        "env_vars": {
            faults.ENV: f"@{root / f'armed-{app}'}",
            faults.DIR_ENV: str(root / f"claims-{app}"),
        }
    }


def write_config(root: Path, target: Path, draft: Path, wide: Path) -> Path:
    """The shared server's Serve config (six applications) and API key file, written under
    `root`; also used to start the same server by hand (`DSBD_TEST_SERVER`). `/fpair` (the
    co-located layout) and `/memory` (`wide`, whose KV cache is large per token, under a small
    session-memory budget) serve tests/serving/test_faults.py, which also arms faults in `/` and
    `/tp`."""
    models = {
        "target": {"source": str(target), "dtype": "float64"},
        "draft": {"source": str(draft), "dtype": "float64"},
    }
    small = {"num_cpus": 0.1}
    quick = {**small, "serve_options": QUICK_HEALTH_CHECKS}
    one = {**small, "max_replicas": 1}
    budget = {"source": str(wide), "dtype": "float64", "session_memory_bytes": MEMORY_BUDGET}
    config = {
        "applications": [
            {
                "name": "dsbd",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "runtime_env": armed_faults(root, "dsbd"),
                "args": {
                    "model_name": MODEL,
                    **models,
                    "router_resources": small,
                    "draft_resources": small,
                    "verifier_resources": quick,
                },
            },
            {
                "name": "spread",
                "route_prefix": "/spread",
                "import_path": "deployments.app:build_app",
                "args": {
                    "model_name": MODEL,
                    **models,
                    "session_affinity": False,
                    "router_resources": small,
                    "draft_resources": {**small, "min_replicas": 2, "max_replicas": 2},
                    "verifier_resources": {**small, "min_replicas": 2, "max_replicas": 2},
                },
            },
            {
                "name": "tp",
                "route_prefix": "/tp",
                "import_path": "deployments.app:build_app",
                "runtime_env": armed_faults(root, "tp"),
                "args": {
                    "model_name": MODEL,
                    "target": {**models["target"], "tp_size": 2},
                    "draft": models["draft"],
                    "router_resources": small,
                    "draft_resources": small,
                    "verifier_resources": quick,
                },
            },
            {
                "name": "guarded",
                "route_prefix": "/guarded",
                "import_path": "deployments.app:build_app",
                "args": {
                    "model_name": MODEL,
                    **models,
                    "router_resources": small,
                    "draft_resources": small,
                    "verifier_resources": small,
                    "default_max_tokens": 16,
                    "api_key_file": str(root / "key"),
                    "limits": GUARD,
                },
            },
            {
                "name": "fpair",
                "route_prefix": "/fpair",
                "import_path": "deployments.app:build_app",
                "runtime_env": armed_faults(root, "fpair"),
                "args": {
                    "model_name": MODEL,
                    **models,
                    "layout": "colocated",
                    "ingress_resources": one,
                    "router_resources": small,
                    "draft_resources": small,
                    "verifier_resources": quick,
                },
            },
            {
                "name": "memory",
                "route_prefix": "/memory",
                "import_path": "deployments.app:build_app",
                "args": {
                    "model_name": "wide",
                    "target": budget,
                    "draft": budget,
                    "ingress_resources": one,  # the whole budget admitted by one ingress
                    "router_resources": small,
                    "draft_resources": small,
                    "verifier_resources": quick,
                },
            },
        ]
    }
    (root / "key").write_text(API_KEY + "\n")
    (root / "serve.yaml").write_text(yaml.safe_dump(config))
    return root / "serve.yaml"


# A replica of the tiny pair's applications: a tenth of a CPU, health-checked every second (a
# killed one is noticed at once).
SMALL_REPLICA = {"num_cpus": 0.1, "serve_options": QUICK_HEALTH_CHECKS}


def tiny_app(target: Path, draft: Path, **args: Any) -> dict[str, Any]:
    """One application of the tiny float64 pair at `/`, its replicas `SMALL_REPLICA`; `args`
    added to (or replacing) its args."""
    return {
        "name": "dsbd",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": {
            "model_name": MODEL,
            "target": {"source": str(target), "dtype": "float64"},
            "draft": {"source": str(draft), "dtype": "float64"},
            "router_resources": SMALL_REPLICA,
            "draft_resources": SMALL_REPLICA,
            "verifier_resources": SMALL_REPLICA,
            **args,
        },
    }


@contextlib.contextmanager
def running_server(root: Path) -> Iterator[dict[str, Any]]:
    """The module's server, started under `root`: url, model dirs, strace dir, log and pid."""
    # "URL MODELS_DIR [PID]": reuse a running server (development only: one started by hand
    # with `write_config`'s config; PID, its `dsbd serve` process, for the memory figures)
    external = os.environ.get("DSBD_TEST_SERVER")
    if external:
        url, models_dir, *pid = external.split()
        yield {
            "url": url,
            "root": Path(models_dir).parent,
            "target": Path(models_dir) / "target",
            "draft": Path(models_dir) / "draft",
            "trace": None,
            "log": None,
            "pid": int(pid[0]) if pid else None,
        }
        return
    target, draft = build_pair(root / "models")
    config = write_config(root, target, draft, build_wide(root / "wide"))
    with serving(root, config, env=SHARED_SERVER_ENV) as info:
        yield {**info, "target": target, "draft": draft}


@contextlib.contextmanager
def serving(
    root: Path, config: Path, start_s: float = 600, env: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """`dsbd serve --config config` on a free loopback port (dsbd/server_process.py), under
    strace where it is installed (every connect/send its processes make, for
    `assert_loopback_only`), stopped with SIGINT and checked to leave nothing running: url, pid,
    root, trace dir (or None) and log. `env`: added to the server's environment.

    `start_s` (how long to wait for it) catches a server that never starts: the 30 replicas
    of `write_config` took ~230 s to start under pytest and strace on the 2-core AMD EPYC
    (benchmarks/results/suite_time_epyc.json, "run_2ff5894"), and longer on a slower machine."""
    trace = root / "trace"
    trace.mkdir()
    traced = shutil.which("strace") is not None
    try:
        server = server_process.start(
            root,
            config,
            num_cpus=8,
            strace_dir=trace if traced else None,
            env=env,
            timeout_s=start_s,
            exit_on_sigterm=False,
        )
    except server_process.ServerStartError as error:
        pytest.fail(str(error))
    assert server.base_url.startswith("http://127.0.0.1:"), server.base_url
    try:
        yield {
            "url": server.base_url,
            "pid": server.pid,
            "root": root,
            "log": server.log,
            "trace": trace if traced else None,
        }
    finally:
        assert not server_process.stop(server), "the server left processes behind"


def assert_loopback_only(server: dict[str, Any]) -> None:
    """Every address the server's processes connected or sent to (strace) is loopback."""
    if server["trace"] is None:
        pytest.skip("strace not installed: the server's processes could not be traced")
    addresses = peers(server["trace"])
    assert addresses, "the trace saw no address at all: is strace recording?"
    outside = sorted(a for a in addresses if not is_loopback(a))
    assert not outside, f"the server tried to reach: {outside}"


def stop(process: subprocess.Popen, interrupt: Any) -> None:
    """Interrupt a server, kill its session if it hangs, and check nothing was left running."""
    assert not server_process.end(process, interrupt), "the server left processes behind"


leftovers = server_process.leftovers
free_port = server_process.free_port


def in_process_decoder(server: dict[str, Any]) -> Any:
    """In-process decoding of the same models: what every distributed decode must equal.
    A seeded decode is a function of its arguments, so each is run once per module and its
    result reused (the three kill tests decode the same 20 bodies)."""
    target = load_causal_lm(str(server["target"]), dtype=torch.float64)
    draft = load_causal_lm(str(server["draft"]), dtype=torch.float64)
    _, stop_ids = load_tokenizer(str(server["target"]))
    decoded: dict[str, Any] = {}

    def decode(method: str, prompt_ids: list[int], stop: Any = None, **knobs: Any):
        key = json.dumps([method, prompt_ids, stop, knobs], sort_keys=True, default=repr)
        if key not in decoded:
            config = SamplingConfig(**{"eos_token_ids": stop_ids, **knobs})  # knobs may set it
            decoded[key] = generate(
                method,
                TransformerScorer(target.model),
                prompt_ids,
                config,
                draft=TransformerScorer(draft.model) if method in METHODS_WITH_DRAFT else None,
                stop=stop,
            )
        return decoded[key]

    return decode


def client(server, prefix: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}{prefix}/v1", api_key="unused", max_retries=0)


def native(server, body: dict, prefix: str = "", timeout: float = 120) -> dict:
    response = requests.post(
        f"{server['url']}{prefix}/v1/dsbd/generate", json=body, timeout=timeout
    )
    assert response.status_code == 200, response.text
    return response.json()


def status(server, prefix: str = "") -> dict:
    return requests.get(f"{server['url']}{prefix}/v1/dsbd/status", timeout=30).json()


def assert_same(got: dict, want) -> None:
    assert [b["token_ids"] for b in got["beams"]] == [b.token_ids for b in want.beams]
    for a, b in zip(got["beams"], want.beams, strict=True):
        assert abs(a["log_likelihood"] - b.log_likelihood) < 1e-9
    stats = {k: v for k, v in got["stats"].items() if k not in ("serving", "accepted_per_position")}
    assert stats == json.loads(json.dumps(want.stats.as_dict()))


IN_FLIGHT = 20  # decodes in flight when a replica is killed (issue 9)


def decode_while_killing(
    server, reference, prefix: str, pid_of: Any, freeze_s: float = 0.0
) -> list[dict]:
    """Start 20 decodes; SIGKILL `pid_of(status)` once all 20 are in flight; all must come
    back, each equal to the in-process engine's decode draw for draw (the lost iterations are
    retried, re-prefilled on a live or replacement replica). With `freeze_s`, the process is
    first stopped (SIGSTOP) for that long: the calls already routed to it then sit in it,
    unanswered, when it dies, so the failure path is certain to run (a plain kill may land
    between two calls, and Serve routes around a dead replica fast)."""
    # 48 tokens: long enough that all 20 are open at once even on a loaded 2-core machine,
    # where the router opens sessions slower than 24-token decodes of these models finish.
    bodies = [
        {
            "prompt_ids": [30 + i % 50, 31, 32],
            "seed": 200 + i,
            "max_new_tokens": 48,
            "width": 2 + i % 2,
            "gamma": 2,
            "adaptive": False,
        }
        for i in range(IN_FLIGHT)
    ]
    # The 20 decodes share two cores with the server's 30 replicas and re-prefill what the kill
    # lost (on /spread, every call to a replica without the session's cache replays it): the
    # three kill tests ran 114-124 s on an Intel Xeon with 2 cores, nearly all of it these
    # decodes, so each may take up to 5 minutes; the bound stays a hang detector.
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(native, server, body, prefix, 300) for body in bodies]
        deadline = time.monotonic() + 60
        while (now := status(server, prefix))["open_sessions"] < IN_FLIGHT:
            assert time.monotonic() < deadline and not any(f.done() for f in futures), now
            time.sleep(0.05)
        pid = pid_of(now)
        if freeze_s:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(freeze_s)
        os.kill(pid, signal.SIGKILL)
        results = [f.result(timeout=360) for f in futures]  # none hangs
    for body, got in zip(bodies, results, strict=True):
        knobs = {k: v for k, v in body.items() if k not in ("prompt_ids", "adaptive")}
        assert_same(got, reference("dsbd", body["prompt_ids"], **knobs))
    return results


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def guarded(server, body: dict, key: str | None = API_KEY, path: str = "completions"):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(
        f"{server['url']}/guarded/v1/{path}",
        headers=headers,
        timeout=60,
        json={"model": MODEL, "prompt": "one two", **body},
    )


def wait_drained(server, prefix: str = "", timeout_s: float = 60) -> dict:
    """Status once no session is open or cached anywhere (fails after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = status(server, prefix)
        if (
            now["open_sessions"] == 0
            and now["verifier"]["cached_sessions"] == 0
            and now["draft"]["cached_sessions"] == 0
        ):
            return now
        assert time.monotonic() < deadline, f"sessions still held: {now}"
        time.sleep(0.2)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
