"""Serving through the loss of Ray's head (issue 50): the GCS on a real Redis, killed under load.

`dsbd serve --gcs-redis` (deployments/gcs_ft.py) starts Ray with its GCS writing the cluster's
tables to a password-protected `redis-server` on loopback (dsbd/bench/local_redis.py, append-only
file on) and starts the GCS again whenever it dies. One server (tiny float64 models, split
layout: ingress, router, draft and verifier replicas), 12 clients decoding seeded requests
(DSBD and beam sampling, streamed and not) in a loop, and:

1. the GCS SIGKILLed: every request sent before, during and after the outage completes with
   the tokens the same request got on the quiet server; then a replica SIGKILLed is replaced
   by Serve (the control plane works again) and no session is left open;
2. Redis stopped and started again (its file keeps what the GCS wrote) under the same load:
   every request completes; a GCS killed after that still comes back with the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import yaml

from deployments.gcs_ft import PASSWORD_ENV
from dsbd.bench.chaos import gcs_pid
from dsbd.bench.local_redis import LocalRedis, local_redis
from tests.support.serving_harness import (
    MODEL,
    SMALL_REPLICA,
    serving,
    status,
    tiny_app,
    wait_drained,
)
from tests.support.tiny_models import build_pair

CLIENTS = 12
RECOVERY_S = 60  # a GCS not listening again by then is a failure, not a slow machine
SERVER_START_S = 600


def _bodies() -> list[dict[str, Any]]:
    """Seeded requests: DSBD and beam sampling, streamed and not (three of each pair)."""
    bodies = []
    for i in range(CLIENTS):
        method = "dsbd" if i % 2 == 0 else "beam"
        bodies.append(
            {
                "model": MODEL,
                "prompt": f"one two {'three ' * (i % 3)}",
                "max_tokens": 16,
                "n": 2,
                "width": 2 + i % 2,
                "seed": 500 + i,
                "method": method,
                "gamma": 2,
                "adaptive": False,
                "stream": i % 4 >= 2,
                "logprobs": 1,
            }
        )
    return bodies


def _complete(url: str, body: dict[str, Any], timeout_s: float = 120) -> list[tuple]:
    """The request's choices as (index, text, token logprobs), streamed or not."""
    response = requests.post(
        f"{url}/v1/completions", json=body, timeout=timeout_s, stream=body["stream"]
    )
    assert response.status_code == 200, response.text
    if not body["stream"]:
        return sorted(
            (c["index"], c["text"], tuple(c["logprobs"]["token_logprobs"]))
            for c in response.json()["choices"]
        )
    texts: dict[int, str] = {}
    logprobs: dict[int, list[float]] = {}
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            index = choice["index"]
            texts[index] = texts.get(index, "") + choice["text"]
            if choice.get("logprobs"):
                logprobs.setdefault(index, []).extend(choice["logprobs"]["token_logprobs"])
    return sorted((i, texts[i], tuple(logprobs.get(i, []))) for i in texts)


def _compare(i: int, got: list[tuple], want: list[tuple]) -> str:
    """ "ok" when the choices have the quiet run's texts, and its token log-probs within 1e-9
    (float64: a batch of another shape may sum in another order, as
    tests/support/serving_harness.py's `assert_same` allows); else what differs."""
    if [c[:2] for c in got] != [c[:2] for c in want]:
        return f"client {i}: other text {[c[1] for c in got]} vs {[c[1] for c in want]}"
    for (_, _, a), (_, _, b) in zip(got, want, strict=True):
        if len(a) != len(b) or any(abs(x - y) > 1e-9 for x, y in zip(a, b, strict=True)):
            return f"client {i}: other log-probs {a} vs {b}"
    return "ok"


class Load:
    """CLIENTS threads, each sending its seeded request again and again until stopped: every
    answer is checked against the quiet one; (start, end, ok) per request."""

    def __init__(self, url: str, expected: list[list[tuple]]) -> None:
        self.url, self.expected = url, expected
        self.records: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def _client(self, i: int) -> None:
        body = _bodies()[i]
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                verdict = _compare(i, _complete(self.url, body), self.expected[i])
            except Exception as error:  # noqa: BLE001 (recorded, asserted on below)
                verdict = f"client {i}: {type(error).__name__}: {error}"
            self.records.append((start, time.monotonic(), verdict))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def spanning(self, since: float, until: float) -> list[tuple[float, float, str]]:
        """Requests in flight at some moment of [since, until]."""
        return [r for r in self.records if r[0] <= until and r[1] >= since]


def _kill_gcs(server: dict[str, Any]) -> tuple[float, float]:
    """SIGKILL the GCS; the time it was killed and the seconds until a new one listens on the
    old one's port."""
    old = gcs_pid(server["pid"])
    assert old is not None, "no single GCS process under the server"
    port = next(c.laddr.port for c in psutil.Process(old).net_connections() if c.status == "LISTEN")
    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    deadline = killed + RECOVERY_S
    while True:
        assert time.monotonic() < deadline, f"no GCS listening on {port} {RECOVERY_S} s after"
        new = gcs_pid(server["pid"])
        with contextlib.suppress(psutil.Error):
            if new not in (None, old) and any(
                c.laddr.port == port and c.status == "LISTEN"
                for c in psutil.Process(new).net_connections()
            ):
                return killed, time.monotonic() - killed
        time.sleep(0.05)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with local_redis(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis: LocalRedis) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("gcs")
    target, draft = build_pair(root / "models")
    one = {**SMALL_REPLICA, "max_replicas": 1}
    app = tiny_app(target, draft, layout="split", router_resources=one, ingress_resources=one)
    config = root / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [app]}))
    env = {"DSBD_GCS_REDIS": redis.address, PASSWORD_ENV: redis.password}
    with serving(root, config, SERVER_START_S, env) as info:
        yield info


@pytest.fixture(scope="module")
def expected(server) -> list[list[tuple]]:
    """Each client's request answered on the quiet server."""
    return [_complete(server["url"], body) for body in _bodies()]


def _assert_all_ok(load: Load, since: float, until: float) -> None:
    failures = [r[2] for r in load.records if r[2] != "ok"]
    assert not failures, failures[:5]
    during = load.spanning(since, until)
    assert during, "no request was in flight during the outage"


def test_the_gcs_killed_under_load_loses_no_request(server, expected) -> None:
    assert b"GCS keeps its tables in Redis" in Path(server["log"]).read_bytes()
    before = status(server)
    with Load(server["url"], expected) as load:
        time.sleep(3)
        killed, outage_s = _kill_gcs(server)
        time.sleep(5)
    print(
        f"GCS killed: back in {outage_s:.2f} s; {len(load.records)} requests, "
        f"{len(load.spanning(killed, killed + outage_s))} in flight during the outage"
    )
    _assert_all_ok(load, killed, killed + outage_s)
    assert len({r[0] for r in load.records if r[0] < killed}) >= CLIENTS  # load before it
    assert any(r[0] > killed + outage_s for r in load.records)  # and after it
    # the control plane works again: a replica killed now is replaced by Serve
    # (the status answers meanwhile: a replica being replaced is reported with pid None)
    draft = before["draft"]["pid"]
    os.kill(draft, signal.SIGKILL)
    killed = time.monotonic()
    unanswered = 0
    while (now := status(server))["draft"].get("pid") in (draft, None):
        assert time.monotonic() < killed + 120, f"the draft replica was not replaced: {now}"
        unanswered += now["draft"]["pid"] is None
        time.sleep(0.5)
    assert _compare(0, _complete(server["url"], _bodies()[0]), expected[0]) == "ok"
    print(
        f"then a draft replica killed: replaced in {time.monotonic() - killed:.1f} s "
        f"({unanswered} status polls reported it unanswered meanwhile)"
    )
    after = wait_drained(server)
    assert after["router"]["calibration"] == before["router"]["calibration"]


def test_redis_restarted_under_load_then_the_gcs_still_recovers(server, expected, redis) -> None:
    with Load(server["url"], expected) as load:
        time.sleep(2)
        stopped = time.monotonic()
        redis.stop()
        time.sleep(2)
        redis.start()
        back = time.monotonic()
        time.sleep(3)
    _assert_all_ok(load, stopped, back)
    with Load(server["url"], expected) as load:
        time.sleep(2)
        killed, outage_s = _kill_gcs(server)
        time.sleep(3)
    print(f"after Redis's restart, GCS killed: back in {outage_s:.2f} s")
    _assert_all_ok(load, killed, killed + outage_s)
    wait_drained(server)
