"""End to end over HTTP: `dsbd serve` on real Ray with tiny real models, the real openai client.

One server for the modules that share it, started the way users start it (`dsbd serve --config
FILE`), under `strace -f` (the whole Ray tree) so the last test here can check that nothing but
loopback was ever contacted; this process's own sockets are watched by an audit hook. Its
applications:

* `/`        session affinity on, one draft and one verifier replica (the verifier
             health-checked every second);
* `/spread`  affinity off, two draft and two verifier replicas: sessions land on replicas
             without their cache and must re-prefill;
* `/tp`      the verifier tensor-parallel over 2 ranks (gloo), health-checked every second;
* `/guarded` an API key and tight limits (width, tokens, concurrency, a 1.5 s deadline):
             its tests are in tests/serving/test_serving_guarded.py;
* `/fpair`, `/memory`, and faults armed in `/` and `/tp`: tests/serving/test_faults.py.

The models run in float64, so a batched forward equals a lone one to ~1e-16 and "the
distributed path returns the same beams as the in-process engine" can be checked draw for draw
even for concurrent requests. The server, its config and the helpers the tests share are in
tests/support/serving_harness.py.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from dsbd_core.models import load_tokenizer
from tests.support.loopback import is_loopback
from tests.support.serving_harness import (
    CASES,
    IN_FLIGHT,
    MODEL,
    REPO,
    _alive,
    _connections,
    _is_ip,
    _state,
    assert_loopback_only,
    assert_same,
    client,
    decode_while_killing,
    in_process_decoder,
    native,
    status,
    wait_drained,
)


@pytest.fixture(scope="module")
def server(served):
    """The `dsbd serve` this module shares with another (tests/conftest.py `served`)."""
    return served


@pytest.fixture(scope="module")
def reference(server):
    """In-process decoding of the same models: what every distributed decode must equal."""
    return in_process_decoder(server)


# ------------------------------------------------------------------------------- OpenAI API
def test_completion_and_chat_with_the_openai_client(server) -> None:
    api = client(server)
    assert [m.id for m in api.models.list().data] == [MODEL]
    completion = api.completions.create(
        model=MODEL,
        prompt="one two three",
        max_tokens=8,
        n=2,
        seed=3,
        extra_body={"width": 3, "gamma": 2},
    )
    assert len(completion.choices) == 2 and all(isinstance(c.text, str) for c in completion.choices)
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0
    assert {c.finish_reason for c in completion.choices} <= {"stop", "length"}
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        n=3,
        extra_body={"method": "beam", "width": 3},
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in chat.choices)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_ends_with_the_text_of_the_same_request_unstreamed(server, chat: bool) -> None:
    api = client(server)
    knobs = {
        "model": MODEL,
        "max_tokens": 12,
        "seed": 5,
        "extra_body": {"adaptive": False, "width": 2, "gamma": 2},
    }
    if chat:
        messages = [{"role": "user", "content": "Say something."}]
        whole = api.chat.completions.create(messages=messages, **knobs).choices[0]
        chunks = list(api.chat.completions.create(messages=messages, stream=True, **knobs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        expected = whole.message.content
    else:
        whole = api.completions.create(prompt="one two", **knobs).choices[0]
        chunks = list(api.completions.create(prompt="one two", stream=True, **knobs))
        streamed = "".join(c.choices[0].text for c in chunks)
        expected = whole.text
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert len(chunks) >= 2


def test_streaming_one_beam_sends_tokens_as_they_are_accepted(server) -> None:
    stream = client(server).completions.create(
        model=MODEL,
        prompt="one",
        max_tokens=16,
        stream=True,
        seed=1,
        extra_body={"method": "sps", "gamma": 2},
        stream_options={"include_usage": True},
    )
    events = list(stream)
    assert events[-1].usage is not None and events[-1].choices == []
    text_events = [e for e in events if e.choices and e.choices[0].text]
    assert len(text_events) >= 3  # several increments, not one final blob


# ------------------------------------------------------------------ the distributed decode
@pytest.mark.parametrize(("method", "knobs"), CASES)
def test_distributed_decode_equals_the_in_process_engine(server, reference, method, knobs):
    prompt_ids = [5, 17, 42, 99, 7]
    body = {
        "prompt_ids": prompt_ids,
        "method": method,
        "seed": 11,
        "max_new_tokens": 14,
        "adaptive": False,
        **knobs,
    }
    got = native(server, body)
    want = reference(method, prompt_ids, seed=11, max_new_tokens=14, **knobs)
    assert_same(got, want)
    serving = got["stats"]["serving"]
    # the router awaited verifier replies and controller answers only: never a forest
    assert set(serving["router_received"]) <= {"VerifyReply", "Knobs"}
    assert serving["verify_cache_hit"][1:] == [True] * (len(serving["verify_cache_hit"]) - 1)


def test_concurrent_requests_share_the_verifier_forward_and_stay_exact(server, reference):
    bodies = [
        {
            "prompt_ids": [3 + i, 8, 13 + i],
            "seed": i,
            "max_new_tokens": 24,
            "width": 2 + i % 2,
            "gamma": 1 + i % 3,
            "adaptive": False,
            "threshold": None if i % 2 else 0.6,
        }
        for i in range(6)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda body: native(server, body), bodies))
    shared = max(max(r["stats"]["serving"]["verify_batch_requests"]) for r in results)
    assert shared >= 2, "no verifier forward served two requests at once"
    assert max(max(r["stats"]["serving"]["draft_batch_requests"]) for r in results) >= 2
    for body, got in zip(bodies, results, strict=True):
        knobs = {k: v for k, v in body.items() if k not in ("prompt_ids", "adaptive")}
        assert_same(got, reference("dsbd", body["prompt_ids"], **knobs))


def test_sessions_on_replicas_without_their_cache_rebuild_it_and_stay_exact(server, reference):
    """No affinity, two replicas a side: calls land where the session's cache is not. These
    decodes are seeded, so the cache is rebuilt by replaying the session's iterations
    (dsbd_core/algorithm/drivers/replay.py), and each decode equals the in-process one draw for
    draw."""
    bodies = [
        {
            "prompt_ids": [20 + i, 21, 22, 23],
            "seed": 100 + i,
            "max_new_tokens": 16,
            "width": 3,
            "gamma": 2,
            "adaptive": False,
        }
        for i in range(4)
    ]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda body: native(server, body, "/spread"), bodies))
    hits, replicas, replays = [], set(), []
    for body, got in zip(bodies, results, strict=True):
        knobs = {k: v for k, v in body.items() if k not in ("prompt_ids", "adaptive")}
        assert_same(got, reference("dsbd", body["prompt_ids"], **knobs))
        hits += got["stats"]["serving"]["verify_cache_hit"][1:]
        replicas |= set(got["stats"]["serving"]["verify_replica"])
        replays += got["stats"]["serving"]["replays"]
    assert len(replicas) == 2
    assert not all(hits), "every call found its cache: the miss path was not exercised"
    assert any("verifier replayed" in r for r in replays), replays


def test_the_session_registry_adapts_the_depth_within_the_limits(server) -> None:
    """The cost model chooses each iteration's depth up to the request's gamma (from the pair's
    measured costs and pass rates: on these two equal-sized models drafting may never pay, so
    every depth may be 0); with fixed knobs every iteration drafts and the per-position
    acceptance metric is reported."""
    got = native(server, {"prompt": "one two three", "max_new_tokens": 30, "gamma": 4, "seed": 2})
    gammas = got["stats"]["serving"]["gamma"]
    assert gammas and all(0 <= g <= 4 for g in gammas)
    body = {"prompt": "one two three", "max_new_tokens": 30, "gamma": 2, "seed": 2}
    fixed = native(server, {**body, "adaptive": False})
    assert max(fixed["stats"]["serving"]["gamma"]) == 2
    per_position = fixed["stats"]["accepted_per_position"]
    assert per_position and len(per_position) <= 2  # the per-position metric is reported


# ----------------------------------------------------------------- tensor-parallel verifier
@pytest.mark.parametrize(("method", "knobs"), CASES[:1] + CASES[3:4])
def test_tensor_parallel_verifier_decodes_exactly(server, reference, method, knobs):
    prompt_ids = [5, 17, 42, 99, 7]
    body = {
        "prompt_ids": prompt_ids,
        "method": method,
        "seed": 12,
        "max_new_tokens": 14,
        "adaptive": False,
        **knobs,
    }
    assert_same(
        native(server, body, "/tp"),
        reference(method, prompt_ids, seed=12, max_new_tokens=14, **knobs),
    )
    verifier = status(server, "/tp")["verifier"]
    assert verifier["tp_size"] == 2 and len(verifier["tp_ranks"]["pids"]) == 2


def test_a_lost_rank_costs_a_retry_and_serve_replaces_the_replica(server, reference) -> None:
    old = status(server, "/tp")["verifier"]
    results = decode_while_killing(
        server, reference, "/tp", lambda now: now["verifier"]["tp_ranks"]["pids"][1]
    )
    retries = [r for got in results for r in got["stats"]["serving"]["retries"]]
    print(f"TP rank killed with {IN_FLIGHT} decodes in flight: {len(retries)} iteration(s) retried")
    assert retries and all("TensorParallelBroken" in r or "ActorDied" in r for r in retries)
    new = status(server, "/tp")["verifier"]
    assert new["replica"] != old["replica"]
    assert not set(new["tp_ranks"]["pids"]) & set(old["tp_ranks"]["pids"])
    for pid in old["tp_ranks"]["pids"]:  # the surviving rank went with its group
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid)


@pytest.mark.parametrize("side", ["verifier", "draft"])
def test_a_killed_replica_loses_no_request(server, reference, side: str) -> None:
    """Every decode completes exactly; calls lost with the killed replica were retried
    (`retries` names the cause). The replica is frozen for a second before it is killed, so the
    calls it had accepted die with it (docs/RELIABILITY.md section 3)."""
    old = status(server, "/spread")[side]
    results = decode_while_killing(
        server, reference, "/spread", lambda now: now[side]["pid"], freeze_s=1.0
    )
    retries = [r for got in results for r in got["stats"]["serving"]["retries"]]
    print(
        f"{side} frozen 1 s then killed with {IN_FLIGHT} decodes in flight: {len(retries)} "
        f"iteration(s) retried: {sorted({r.split(': ')[1] for r in retries})}"
    )
    # Serve reroutes the calls a frozen replica never accepted, and a verify call is routed only
    # once its forest is resolved, so a kill loses only the calls accepted before the freeze:
    # 0 or a few (draft: 0 in 2 of ~13 runs; verifier: 1, then 0 in 2 of 2 runs once the model
    # replicas ran with jemalloc and answered faster). Here only "all complete, exact, the
    # retries name a lost replica" is checked; tests/serving/test_faults.py makes the retry certain
    # (a replica that exits inside its N-th call) and asserts it for draft, verifier, TP rank
    # and router.
    assert all("ActorDied" in r or "Unavailable" in r for r in retries), retries
    deadline = time.monotonic() + 120
    while (pid := status(server, "/spread")[side]["pid"]) == old["pid"] or not _alive(pid):
        assert time.monotonic() < deadline, "no live replica answers after the kill"
        time.sleep(0.5)


def test_fuzzing_the_served_openapi_finds_no_server_error(server, tmp_path: Path) -> None:
    """schemathesis (bounded): schema examples and random requests, valid and invalid, against
    every route; any 5xx fails. Its own coverage phase is left out: it crashes inside
    schemathesis 4.32 on this schema (a hypothesis cache KeyError), not in the server."""
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{server['url']}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--phases",
        "examples,fuzzing",
        "--max-time",
        "60",
        "--workers",
        "1",
        "--seed",
        "1",
        "--suppress-health-check",
        "all",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    tail = done.stdout[-6000:]
    print("schemathesis:", "\n".join(done.stdout.strip().splitlines()[-12:]))
    assert "Server error" not in done.stdout and "ST101" not in done.stdout, tail
    assert "generated" in done.stdout, tail  # it did run requests
    assert done.returncode == 0, tail


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"width": 0}, "width=0"),
        ({"n": 5, "width": 3}, "n=5 is larger than width=3"),
        ({"max_tokens": 1000}, "exceeds the model's 256 positions"),
        ({"stop": ["one", ""]}, "stop[1]='' is empty"),
        ({"stop": ["x"] * 17}, "17 stop strings; allowed: at most 16"),
        ({"stop": "y" * 257}, "stop[0] is 257 characters; allowed: at most 256"),
        (
            {"frequency_penalty": 2.5},
            "frequency_penalty=2.5: Input should be less than or equal to 2",
        ),
        ({"unknown_knob": 1}, "unknown_knob"),
        ({"temperature": -0.5}, "temperature=-0.5"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body: dict, fragment: str) -> None:
    response = requests.post(
        f"{server['url']}/v1/completions", json={"model": MODEL, "prompt": "x", **body}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_the_schema_is_served(server) -> None:
    with pytest.raises(openai.NotFoundError, match="available: 'tiny'"):
        client(server).completions.create(model="gpt-4", prompt="x")
    schema = requests.get(f"{server['url']}/openapi.json", timeout=30).json()
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/dsbd/generate",
        "/v1/models",
        "/healthz",
    } <= set(schema["paths"])
    assert requests.get(f"{server['url']}/healthz", timeout=30).json()["status"] == "ok"


def test_finished_and_cancelled_requests_free_their_sessions(server) -> None:
    # a stream the client abandons after its first event
    with requests.post(
        f"{server['url']}/v1/completions",
        stream=True,
        timeout=60,
        json={"model": MODEL, "prompt": "one", "max_tokens": 200, "stream": True, "method": "sps"},
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    deadline = time.monotonic() + 60
    status = {}
    while time.monotonic() < deadline:
        status = requests.get(f"{server['url']}/v1/dsbd/status", timeout=30).json()
        if status["open_sessions"] == 0 and status["verifier"]["cached_sessions"] == 0:
            break
        time.sleep(0.5)
    assert status["open_sessions"] == 0 and status["verifier"]["cached_sessions"] == 0, status


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_stops_its_decode_within_one_iteration(
    server, reference, stream: bool
) -> None:
    """A client closes its connection mid-decode (a plain request: Serve's proxy sees the
    disconnect and cancels the router's handler, and Serve its child calls; a stream: the
    same). Measured with the verifier's count of calls answered: read just before the close,
    at most the iteration in flight and one begun between that read and the close may follow,
    out of the dozens the decode still had; every session is freed on both replicas."""
    knobs = {"method": "dsbd", "width": 3, "gamma": 2, "seed": 9, "max_tokens": 200}
    tokenizer, _ = load_tokenizer(str(server["target"]))
    prompt_ids = tokenizer.encode("one two")
    full = reference("dsbd", prompt_ids, width=3, gamma=2, seed=9, max_new_tokens=200)
    before = wait_drained(server)
    host, port = server["url"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": "one two", "adaptive": False, "stream": stream, **knobs}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    if stream:
        assert connection.getresponse().status == 200  # headers: the stream has begun
    deadline = time.monotonic() + 60
    while (now := status(server))["verifier"]["calls_run"] - before["verifier"]["calls_run"] < 5:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    at_close = status(server)["verifier"]["calls_run"]
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    closed = time.monotonic()
    after = wait_drained(server, timeout_s=30)
    freed_s = time.monotonic() - closed
    ran = at_close - before["verifier"]["calls_run"]
    left = full.stats.iterations - ran
    assert left >= 20, f"the decode was nearly done ({ran} of {full.stats.iterations})"
    ran_after = after["verifier"]["calls_run"] - at_close
    assert ran_after <= 2, f"{ran_after} iterations ran after the disconnect ({left} were left)"
    print(
        f"disconnect ({'stream' if stream else 'plain'}): {ran_after} iteration(s) after the "
        f"close, of {left} left; sessions freed {freed_s:.2f} s after it"
    )


def test_64_clients_load_no_errors_flat_memory_and_sessions_drain(server, tmp_path) -> None:
    """Bounded form of the load figure (docs/RELIABILITY.md has the 60 s runs): 64 concurrent
    clients for 15 s, mixed routes and methods, a quarter of them going away mid-decode.
    No error; the server's process-tree memory after warm-up within 10% of its first
    post-warm-up value; every session freed afterwards."""
    out = tmp_path / "load.json"
    command = [
        sys.executable,
        "-m",
        "dsbd",
        "bench",
        "load",
        "--url",
        server["url"],
        "--model",
        MODEL,
        "--clients",
        "64",
        "--duration",
        "15",
        "--max-tokens",
        "8",
        "--settle",
        "60",
        "--out",
        str(out),
    ]
    if server["pid"] is not None:
        command += ["--pid", str(server["pid"])]
    subprocess.run(command, check=True, timeout=300, cwd=REPO)
    results = json.loads(out.read_text())
    print({k: v for k, v in results.items() if k != "samples"})
    assert results["errors"] == {}, results["error_examples"]
    assert results["ok"] >= 64 and results["abandoned"] >= 8, results
    assert all(v == 0 for k, v in results["sessions_after"].items() if k != "drained_after_s")
    if server["pid"] is not None:
        rss = results["memory"]["rss"]
        assert rss["max_growth"] <= 0.10 and rss["max_drop"] <= 0.10, results["memory"]


# -------------------------------------------------------------------------------- network
def test_nothing_but_loopback_was_contacted(server) -> None:
    assert_loopback_only(server)
    ours = {a[0] for a in _connections if isinstance(a, tuple) and a}
    assert ours and all(is_loopback(a) for a in ours if _is_ip(a)), ours
