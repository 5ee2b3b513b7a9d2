"""The spans and metrics of a request (ingress) and its iterations (router):
deployments/observability/tracing.py, metrics.py.

* `RequestObserver` is an ASGI middleware around the ingress's FastAPI app. For the decode routes
  it opens the `dsbd.request` span (a child of the client's span when the request carries a W3C
  `traceparent` header) and counts the request (`dsbd_requests{method,status}`, latency) when
  the last byte is sent (`dsbd_requests{method,status,model}`), so a streamed response is
  measured to its end. It is pure ASGI rather
  than Starlette's `BaseHTTPMiddleware`, which would end at the response headers of a stream.
* `SessionObserver` follows one `DecodeSession`: an `dsbd.iteration` span per iteration, whose
  W3C context goes to the draft and the verifier in the `IterationCall`, and the metrics of the
  verified outcome (`IterationSample`), time to first token and the open-sessions gauge.

A handler tells the middleware the request's decoding method through `note_method`: the
middleware puts a small mutable record in a context variable before the app runs, which the
handler's task sees whether or not Starlette copied the context on the way.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from deployments.observability import tracing
from deployments.observability.metrics import IterationSample, serving_metrics

DECODE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/dsbd/generate")
CLIENT_CLOSED = 499  # status recorded when the client went away before a response started


@dataclass
class RequestInfo:
    """What the handler learns about a request that the middleware reports."""

    start: float = field(default_factory=time.perf_counter)
    method: str = "none"  # the decoding method; "none": refused before the body was read
    model: str = "none"  # the served model it named; "none": refused before that


_REQUEST: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar(
    "dsbd_request", default=None
)


def note_method(method: str) -> None:
    """Record the decoding method of the request being handled (for `dsbd_requests`)."""
    info = _REQUEST.get()
    if info is not None:
        info.method = method
    trace.get_current_span().set_attribute("dsbd.method", method)


def note_model(model: str) -> None:
    """Record the served model a request names (for `dsbd_requests{model}`: an ingress may
    serve several, deployments/llm_serving.py)."""
    info = _REQUEST.get()
    if info is not None:
        info.model = model
    trace.get_current_span().set_attribute("dsbd.model", model)


def is_decode_route(path: str) -> bool:
    """Whether a path is a decode route (under any application's route prefix)."""
    return path.rstrip("/").endswith(DECODE_ROUTES)


class RequestObserver:
    """ASGI middleware: the request span and the request metrics of the decode routes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_decode_route(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        info = RequestInfo()
        info_token = _REQUEST.set(info)
        tracer = tracing.tracer(tracing.INGRESS)
        span: Span | None = None
        context_token = None
        if tracing.enabled():
            span = tracer.start_span(
                "dsbd.request",
                context=tracing.extract_headers(scope.get("headers", [])),
                kind=SpanKind.SERVER,
                attributes={
                    "http.request.method": scope.get("method", ""),
                    "url.path": scope.get("path", ""),
                },
            )
            context_token = otel_context.attach(trace.set_span_in_context(span))
        status: int | None = None

        async def observed_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        error: BaseException | None = None
        try:
            await self.app(scope, receive, observed_send)
        except asyncio.CancelledError as cancelled:
            error, status = cancelled, status or CLIENT_CLOSED
            raise
        except BaseException as failure:
            error, status = failure, status or 500
            raise
        finally:
            seconds = time.perf_counter() - info.start
            final = status if status is not None else 500
            if context_token is not None:
                otel_context.detach(context_token)
            _REQUEST.reset(info_token)
            if span is not None:
                span.set_attribute("http.response.status_code", final)
                span.set_attribute("dsbd.method", info.method)
                if error is not None and final >= 500:
                    tracing.fail(span, error)
                elif final >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {final}"))
                span.end()
            serving_metrics().request(info.method, final, seconds, info.model)


class SessionObserver:
    """Spans and metrics of one decode session (`DecodeSession.iterations`)."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.metrics = serving_metrics()
        self.tracer = tracing.tracer(tracing.ROUTER)
        self.request = _REQUEST.get()
        self.start = self.request.start if self.request is not None else time.perf_counter()
        self.first_token_seen = False
        self.totals = {
            "iterations": 0,
            "tokens": 0,
            "draft_tokens": 0,
            "verified_draft_tokens": 0,
            "accepted_tokens": 0,
        }
        self.parent = trace.get_current_span()  # the request span (or a no-op one)
        self.parent.set_attribute("dsbd.session", session)
        self.metrics.session_opened()
        self.closed = False

    @contextmanager
    def iteration(self, index: int, gamma: int, draft_width: int, depth: int) -> Iterator[Any]:
        """Span and timing of one iteration; `it.trace` goes into the IterationCall, and
        `it.done(reply)` records the verified outcome."""
        span = self.tracer.start_span(
            "dsbd.iteration",
            kind=SpanKind.INTERNAL,
            attributes={
                "dsbd.session": self.session,
                "dsbd.iteration": index,
                "dsbd.gamma": gamma,
                "dsbd.draft_width": draft_width,
                "dsbd.depth": depth,
            },
        )
        observed = _Iteration(self, span, tracing.inject(span), time.perf_counter())
        try:
            yield observed
        except BaseException as error:
            tracing.fail(span, error)
            raise
        finally:
            span.end()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.metrics.session_closed()
        self.parent.set_attributes({f"dsbd.{name}": value for name, value in self.totals.items()})


@dataclass
class _Iteration:
    observer: SessionObserver
    span: Span
    trace: dict[str, str]
    start: float

    def done(self, reply: Any, retries: int = 0) -> IterationSample:
        """Record a verified iteration (`reply`: the VerifyReply the router applied)."""
        observer = self.observer
        now = time.perf_counter()
        sample = IterationSample.from_outcome(reply.outcome)
        observer.metrics.iteration(sample, now - self.start)
        if sample.generated_tokens and not observer.first_token_seen:
            observer.first_token_seen = True
            observer.metrics.first_token_after(now - observer.start)
        totals = observer.totals
        totals["iterations"] += 1
        totals["tokens"] += sample.generated_tokens
        totals["draft_tokens"] += sample.draft_tokens
        totals["verified_draft_tokens"] += sample.verified_draft_tokens
        totals["accepted_tokens"] += sample.accepted_tokens
        if self.span.is_recording():
            attributes = sample.attributes() | {
                "dsbd.verifier.replica": reply.report.replica,
                "dsbd.verifier.batch_requests": reply.report.batch.requests,
                "dsbd.retries": retries,
            }
            if reply.draft is not None:
                attributes["dsbd.draft.replica"] = reply.draft.replica
                attributes["dsbd.draft.batch_requests"] = reply.draft.batch.requests
            self.span.set_attributes(attributes)
        return sample
