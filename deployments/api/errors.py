"""The router's client errors: `APIError` and the OpenAI-style error bodies it becomes.

Bad input is answered with HTTP 400 and an OpenAI-style error naming the field, the value given and
what is allowed; the handlers here are registered on the ingress app (deployments/api/ingress.py) so
every route, and FastAPI's own request validation, answers the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dsbd_core.algorithm.config import SamplingConfig, config_error_message, error_words


class APIError(Exception):
    """An error a client can act on: HTTP status, message, offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        kind: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers


async def api_error_handler(request: Request, error: APIError) -> JSONResponse:
    response = error_response(
        error.status, error.message, error.param, kind=error.kind, code=error.code
    )
    response.headers.update(error.headers or {})
    return response


async def validation_error_handler(request: Request, error: RequestValidationError) -> JSONResponse:
    lines, param = [], None
    for item in error.errors():
        if item.get("type") == "json_invalid":  # its loc is ("body", offset): name the body
            where = item.get("loc", ("body", "?"))[-1]
            why = (item.get("ctx") or {}).get("error", "JSON decode error")
            lines.append(f"body: not valid JSON at character {where}: {why}")
            param = param or "body"
            continue
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        param = param or field
        value = item.get("input")
        message = error_words(item)
        if not loc:  # a model-level rule: its message names the fields itself
            lines.append(message)
            continue
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{field}{shown}: {message}")
    return error_response(400, "; ".join(lines), param)


def error_response(
    status: int,
    message: str,
    param: str | None,
    *,
    kind: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def requested_config(build: Callable[[], SamplingConfig]) -> SamplingConfig:
    """The request's SamplingConfig, or 400 for a combination of knobs no decoder accepts (its
    cross-field rules). Only here is a pydantic error the client's: anywhere else it is a bug
    of the server and must show as one (500), not be passed off as bad input."""
    try:
        return build()
    except ValidationError as error:
        loc = error.errors()[0]["loc"]
        raise APIError(
            400, config_error_message(error).replace("\n", "; "), str(loc[0]) if loc else None
        ) from None


# How long a client should wait before it sends again a request that found no replica.
RETRY_AFTER_S = 5


async def unhandled_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Any error no route turned into a response: 503, retryable, when a replica the decode
    needed was gone and none took its place within the router's retry window (a replacement
    needs Ray's control plane: while the GCS restarts none can start, docs/RELIABILITY.md
    section 12); else 500, both in the OpenAI shape."""
    from deployments.decode.session import lost_replica

    lost = lost_replica(error)
    if lost is None:
        return error_response(500, f"internal error: {type(error).__name__}", None)
    message = (
        f"a replica this decode needed was lost ({type(lost).__name__}) and none took its "
        "place within the retry window (replicas are being replaced, or Ray's control plane "
        f"is recovering); retry the request in {RETRY_AFTER_S} s"
    )
    response = error_response(503, message, None, kind="replica_unavailable")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def replica_lost_body(why: str) -> dict[str, Any]:
    """The error event of a stream whose decode was lost with its router and could not be
    replayed to the tokens already sent (deployments/decode/client.py)."""
    message = (
        f"the decode was lost with its router replica and its replay differs from the "
        f"text already sent ({why}); retry the request"
    )
    return {"error": {"message": message, "type": "replica_lost", "param": None, "code": 503}}


def timeout_body(request_timeout_s: float) -> dict[str, Any]:
    """The 504 body of a decode stopped at the server's `request_timeout_s` limit."""
    message = (
        f"the decode did not finish within request_timeout_s={request_timeout_s}; "
        "it was stopped and its sessions freed; ask for fewer tokens or retry"
    )
    return {"error": {"message": message, "type": "timeout", "param": None, "code": 504}}
