"""The shared server's `/guarded` application over HTTP: an API key and tight limits (width,
tokens, prompt, n, concurrency, a 1.5 s deadline), each refused with the field, its value and
the limit, and nothing left running after a refusal or a deadline; the key never written to a
log. The server and its config are in tests/support/serving_harness.py (tests/conftest.py `served`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from tests.support.serving_harness import API_KEY, MODEL, client, guarded


@pytest.fixture(scope="module")
def server(served):
    """The `dsbd serve` this module shares with others (tests/conftest.py `served`)."""
    return served


def test_the_api_key_is_required_before_anything_else(server) -> None:
    """Missing or wrong key: 401 on every route but the probe and the API description, and
    before the body is validated (a client without the key learns nothing about its fields)."""
    for key in (None, "sk-wrong", API_KEY[:-1]):
        response = guarded(server, {"max_tokens": 2}, key=key)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    for body in ({"width": 0}, {"unknown_knob": 1}, {"max_tokens": 10**6}):
        response = guarded(server, body, key=None)
        assert response.status_code == 401, (body, response.text)
    base = f"{server['url']}/guarded"
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/v1/dsbd/status"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/dsbd/generate"),
    ]
    for method, path in routes:
        response = requests.request(method, base + path, json={}, timeout=30)
        assert response.status_code == 401, (path, response.text)
    assert requests.get(f"{base}/healthz", timeout=30).status_code == 200
    assert "/v1/completions" in requests.get(f"{base}/openapi.json", timeout=30).json()["paths"]
    assert guarded(server, {"max_tokens": 2}).status_code == 200
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 2}
    response = requests.post(
        f"{base}/v1/completions", headers={"x-api-key": API_KEY}, json=body, timeout=60
    )
    assert response.status_code == 200, response.text
    api = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    assert api.completions.create(model=MODEL, prompt="one", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        client(server, "/guarded").completions.create(model=MODEL, prompt="one", max_tokens=2)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"width": 5}, "width=5 exceeds this server's limit max_width=4"),
        ({"gamma": 4}, "gamma=4 exceeds this server's limit max_gamma=3"),
        ({"max_tokens": 241}, "max_tokens=241 exceeds this server's limit max_new_tokens=240"),
        ({"prompt": "one two " * 20}, "exceeds this server's limit max_prompt_tokens=24"),
        ({"n": 3, "width": 3}, "n=3 exceeds this server's limit max_n=2"),
        ({"w_min": 3, "width": 2}, "w_min=3 is larger than width=2"),
    ],
)
def test_limits_are_enforced_naming_field_value_and_limit(server, body, fragment) -> None:
    response = guarded(server, body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


def test_the_native_route_names_its_own_fields(server) -> None:
    """/v1/dsbd/generate calls the budget `max_new_tokens` (OpenAI routes: `max_tokens`)."""
    response = requests.post(
        f"{server['url']}/guarded/v1/dsbd/generate",
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt_ids": [5, 6], "max_new_tokens": 241},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_new_tokens"
    assert "max_new_tokens=241 exceeds this server's limit max_new_tokens=240" in error["message"]


@pytest.mark.parametrize(
    "knobs",
    [{"method": "beam", "width": 4}, {"method": "dsbd", "width": 4, "gamma": 1, "adaptive": False}],
)
def test_past_the_deadline_504_and_the_sessions_are_freed(server, knobs: dict) -> None:
    """A 240-token decode cannot finish within the 1.5 s deadline (each iteration is at least
    one Serve call, DSBD's gamma 1 emits at most 2 tokens per iteration): 504, or a timeout
    event for a stream, and every session freed: the controller's, the verifier's and (DSBD)
    the draft's."""
    start = time.monotonic()
    response = guarded(server, {"max_tokens": 240, **knobs})
    assert response.status_code == 504, response.text
    assert "request_timeout_s=1.5" in response.json()["error"]["message"]
    assert time.monotonic() - start < 10
    stream = guarded(server, {"max_tokens": 240, "stream": True, **knobs})
    assert stream.status_code == 200 and '"type": "timeout"' in stream.text
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + 30
    while True:
        now = requests.get(
            f"{server['url']}/guarded/v1/dsbd/status", headers=headers, timeout=30
        ).json()
        if (
            now["open_sessions"] == 0
            and now["verifier"]["cached_sessions"] == 0
            and now["draft"]["cached_sessions"] == 0
        ):
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.3)


def test_more_concurrent_decodes_than_allowed_get_429(server) -> None:
    """Two streams hold both decode slots (max_concurrent_sessions=2): every other decode is
    refused with 429 meanwhile; once their clients go away the slots are free again (an
    abandoned stream is counted out however it ends). Streams, because a stream holds its slot
    from its headers on, whatever the machine's speed: plain decodes raced the 1.5 s deadline
    (504) on a loaded machine."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": MODEL,
        "prompt": "one two",
        "max_tokens": 240,
        "method": "beam",
        "width": 2,
        "stream": True,
    }
    streams = [
        requests.post(
            f"{server['url']}/guarded/v1/completions",
            json=body,
            stream=True,
            headers=headers,
            timeout=60,
        )
        for _ in range(2)
    ]
    try:
        assert [s.status_code for s in streams] == [200, 200]
        with ThreadPoolExecutor(4) as pool:
            refused = list(pool.map(lambda _: guarded(server, {"max_tokens": 2}), range(4)))
        assert [r.status_code for r in refused] == [429] * 4, [r.text for r in refused]
        assert "max_concurrent_sessions" in refused[0].json()["error"]["message"]
    finally:
        for stream in streams:
            stream.close()
    deadline = time.monotonic() + 30
    while (code := guarded(server, {"max_tokens": 2}).status_code) == 429:
        assert time.monotonic() < deadline, "the abandoned streams still hold their slots"
        time.sleep(0.2)
    assert code == 200


# ------------------------------------------------------------------------------- secrets
def test_the_api_key_appears_in_no_log(server) -> None:
    """After every test above sent it (right, wrong and cut short): not in the server's output
    nor in any of Ray's session logs (every replica's and the proxy's access logs)."""
    if server["log"] is None:
        pytest.skip("an external server: its logs are not ours to read")
    logs = [server["log"], *Path("/tmp/ray/session_latest/logs").rglob("*")]
    needle = API_KEY.encode()
    read = 0
    for path in logs:
        if path.is_file():
            data = path.read_bytes()
            read += 1
            assert needle not in data, f"the API key is in {path}"
    assert read > 1, "no Ray log was found to check"
    print(f"API key absent from {read} log files (server output and Ray's session logs)")
