"""The API key: read from a file or DSBD_API_KEY, demanded before the body is even validated.

The middleware is driven as plain ASGI (no HTTP client needed) around a small FastAPI app with a
validated body, so "401 comes before 400" is checked directly; `tests/serving/test_serving.py`
checks the same against the served application.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from deployments.api.auth import APIKeyGuard, guard_with, read_api_key

KEY = "sk-unit-42"


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(ge=1)


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(APIKeyGuard)

    @app.post("/v1/completions")
    async def completions(body: Body) -> dict:
        return {"width": body.width}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return app


def call(
    app,
    method: str,
    path: str,
    body: dict | None = None,
    headers: dict[str, str] | None = None,
    root_path: str = "",
) -> tuple[int, dict, dict]:
    """One request through the ASGI app: (status, headers, JSON body)."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": root_path + path,
        "raw_path": (root_path + path).encode(),
        "root_path": root_path,
        "query_string": b"",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "headers": [
            (k.lower().encode(), v.encode())
            for k, v in {"content-type": "application/json", **(headers or {})}.items()
        ],
    }
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], response_headers, json.loads(content) if content else {}


@pytest.fixture
def keyed():
    guard_with(KEY.encode())
    yield _app()
    guard_with(None)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-wrong"},
        {"authorization": f"Bearer {KEY[:-1]}"},
        {"x-api-key": "sk-wrong"},
        {"authorization": KEY},
    ],
)
def test_without_the_key_401_comes_before_any_validation(keyed, headers) -> None:
    for body in ({"width": 0}, {"unknown": 1}, None, {"width": 2}):
        status, response_headers, content = call(keyed, "POST", "/v1/completions", body, headers)
        assert status == 401, content
        assert response_headers["www-authenticate"] == "Bearer"
        assert content["error"]["type"] == "authentication_error"
        assert KEY not in json.dumps(content)


@pytest.mark.parametrize(
    "headers",
    [{"authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"x-api-key": KEY}],
)
def test_with_the_key_the_app_answers(keyed, headers) -> None:
    assert call(keyed, "POST", "/v1/completions", {"width": 2}, headers)[0] == 200
    status, _, content = call(keyed, "POST", "/v1/completions", {"width": 0}, headers)
    assert status == 422 and content["detail"][0]["loc"] == ["body", "width"]


@pytest.mark.parametrize("root_path", ["", "/guarded"])
def test_probes_and_the_api_description_need_no_key(keyed, root_path: str) -> None:
    assert call(keyed, "GET", "/healthz", root_path=root_path)[0] == 200
    assert call(keyed, "GET", "/openapi.json", root_path=root_path)[0] == 200
    assert call(keyed, "POST", "/v1/completions", {"width": 1}, root_path=root_path)[0] == 401


def test_no_key_configured_leaves_the_app_open() -> None:
    guard_with(None)
    assert call(_app(), "POST", "/v1/completions", {"width": 2})[0] == 200


def test_the_key_comes_from_the_file_else_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("DSBD_API_KEY", raising=False)
    assert read_api_key(None) is None
    monkeypatch.setenv("DSBD_API_KEY", " sk-env \n")
    assert read_api_key(None) == b"sk-env"
    (tmp_path / "key").write_text("sk-file\n")
    assert read_api_key(str(tmp_path / "key")) == b"sk-file"  # the file wins
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="api_key_file=.*empty"):
        read_api_key(str(tmp_path / "empty"))
