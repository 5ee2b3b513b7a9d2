"""The optional API key: where it comes from, and the middleware that demands it.

The key is checked by an ASGI middleware, before FastAPI reads or validates the body: a client
without the key learns nothing but 401, not which of its fields were wrong (a handler-level
check runs after validation, so a bad body without a key got 400). Compared with
`hmac.compare_digest` (time independent of where the strings differ); never logged or echoed.
Serve logs application arguments, so the config names a file holding the key, never the key.

Open without a key: `/healthz` (liveness probes) and the API's description (`/openapi.json`,
`/docs`, `/redoc`), which hold no data.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def read_api_key(path: str | None) -> bytes | None:
    """The API key from `path` (one line) or DSBD_API_KEY; None: no key. An empty key file is
    refused (a forgotten key must not silently open the server)."""
    if path is not None:
        key = Path(path).expanduser().read_text().strip()
        if not key:
            raise ValueError(f"api_key_file={path!r} is empty")
        return key.encode()
    key = os.environ.get("DSBD_API_KEY", "").strip()
    return key.encode() if key else None


def presented_key(headers: Headers) -> str:
    """What the client sent: `Authorization: Bearer KEY` (the openai client) or `x-api-key`."""
    given = headers.get("authorization", "")
    if given[:7].lower() == "bearer ":
        return given[7:]
    return headers.get("x-api-key", "")


def unauthorized() -> JSONResponse:
    """401 in OpenAI's error shape, with the challenge RFC 6750 asks for."""
    body = {
        "error": {
            "message": "missing or wrong API key; send it as `Authorization: Bearer KEY`",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class APIKeyGuard:
    """ASGI middleware: 401 for every request without the key, before the app sees it.

    The key is set once per process by the ingress replica (`guard_with`): one Serve replica
    is one process serving one application, so a module-level key cannot leak between apps.
    """

    key: bytes | None = None

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        key = APIKeyGuard.key
        if scope["type"] != "http" or key is None or _route(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = presented_key(Headers(scope=scope)).encode()
        if hmac.compare_digest(given, key):
            await self.app(scope, receive, send)
            return
        await unauthorized()(scope, receive, send)


def guard_with(key: bytes | None) -> None:
    """Require `key` (None: no key) of every request this process's app serves."""
    APIKeyGuard.key = key


def _route(scope: dict[str, Any]) -> str:
    """The path inside the application: Serve mounts an app under its route prefix, which
    arrives as `root_path` (and, depending on the ASGI server, also at the head of `path`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "").rstrip("/")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"
