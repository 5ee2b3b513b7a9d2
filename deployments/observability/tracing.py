"""OpenTelemetry tracing of the serving path: request > iteration > draft / verify, over OTLP.

Why it looks like this:

* **Off unless asked for.** A process exports spans only when `OTEL_EXPORTER_OTLP_ENDPOINT`
  (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and `OTEL_SDK_DISABLED` is not `true`.
  Otherwise `tracer()` is OpenTelemetry's no-op tracer: no provider, no exporter (its module is
  not even imported), no connection, and the span calls on the hot path cost a few
  microseconds. The check happens once per process, lazily, at the first span.
* **One provider per Ray process, never the global one.** The ingress, the router, every draft
  and every verifier replica are separate processes; each builds its own `TracerProvider` whose
  resource names the service (`dsbd-ingress`, `dsbd-router`, `dsbd-draft`, `dsbd-verifier`) and
  the Serve replica id
  (`service.instance.id`). It is kept here rather than installed globally, so Ray Serve's own
  (file-based, off by default) tracing, which sets the global provider, cannot collide with it.
  The standard OTEL_* variables (headers, timeout, sampler, batch delay, resource attributes)
  are read by the SDK and the OTLP/HTTP exporter as usual.
* **W3C trace context in the call messages.** The ingress injects the request span into the
  `DecodeCall` it hands a router, whose iteration spans are its children. The router injects its
  iteration span into the
  `IterationCall` it sends (`IterationCall.trace`: `traceparent`/`tracestate`), and the draft
  and verifier replicas start their spans from it: one trace from the HTTP request to every
  forward that served it, across processes and machines. The router decides: a call that
  carries no context gets no span in the replica. An incoming HTTP `traceparent` header makes
  the request span a child of the client's span (deployments/observability/observers.py).
* **Batched forwards.** One forward serves the calls of several requests. Each call gets its own
  span (a child of its request's iteration, so every trace is complete), all spans of one batch
  share `dsbd.batch.id`, and each is linked (span links) to the spans of the other calls of its
  batch: from one request's verify span a trace viewer jumps to the requests it was batched with.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

INGRESS, ROUTER = "dsbd-ingress", "dsbd-router"
DRAFT, VERIFIER = "dsbd-draft", "dsbd-verifier"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
INSTRUMENTATION = "dsbd"
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate


def export_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process should export spans (an OTLP endpoint is set, the SDK not off)."""
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def replica_id() -> str:
    """This Serve replica's id (`pid-N` outside a replica: tests, scripts)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid-{os.getpid()}"


@dataclass
class _Setup:
    tracer: Tracer
    provider: Any  # the SDK TracerProvider, None when not exporting


_setup: _Setup | None = None
_lock = threading.Lock()


def tracer(service: str) -> Tracer:
    """This process's tracer; the first call decides (service name, exporting or not)."""
    global _setup
    if _setup is None:
        with _lock:
            if _setup is None:
                _setup = _build(service)
    return _setup.tracer


def enabled() -> bool:
    """Whether this process records spans (after its first `tracer()` call)."""
    return _setup is not None and _setup.provider is not None


def use_provider(provider: Any | None) -> None:
    """Replace this process's tracing (tests: an SDK provider with an in-memory exporter;
    None: back to undecided, the next `tracer()` call reads the environment again)."""
    global _setup
    with _lock:
        _setup = (
            None if provider is None else _Setup(provider.get_tracer(INSTRUMENTATION), provider)
        )


def shutdown() -> None:
    """Flush and stop the exporter (spans still queued are sent)."""
    if _setup is not None and _setup.provider is not None:
        _setup.provider.shutdown()


def _build(service: str) -> _Setup:
    if not export_configured():
        return _Setup(trace.NoOpTracer(), None)
    # Imported only here: a process that does not export never loads the exporter.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    replica = replica_id()
    resource = Resource.create(
        {
            "service.name": service,
            "service.namespace": "dsbd",
            "service.instance.id": replica,
            "dsbd.replica": replica,
        }
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return _Setup(provider.get_tracer(INSTRUMENTATION), provider)


# --------------------------------------------------------------------------- propagation
def inject(span: Span) -> dict[str, str]:
    """The W3C carrier (`traceparent`, `tracestate`) of `span`; empty for a no-op span."""
    carrier: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The context a carrier holds (None when it holds none)."""
    if not carrier:
        return None
    context = _PROPAGATOR.extract(dict(carrier))
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def extract_headers(headers: Sequence[tuple[bytes, bytes]]) -> Context | None:
    """The client's trace context from raw ASGI headers (`traceparent`, `tracestate`)."""
    carrier = {
        name.decode("latin-1").lower(): value.decode("latin-1")
        for name, value in headers
        if name.lower() in (b"traceparent", b"tracestate")
    }
    return extract(carrier)


def fail(span: Span, error: BaseException) -> None:
    """Mark a span failed with the error that ended it."""
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))


# --------------------------------------------------------------------------- batched calls
class BatchSpans:
    """One span per call of a batched forward, linked to each other (see the module docstring).

    `calls` are (session, `IterationCall`), `batch` what all spans share. Spans start on
    `__enter__` (the forward begins) and end on `__exit__`; `finish` adds what the forward
    produced.
    """

    def __init__(
        self, service: str, name: str, calls: Sequence[tuple[str, Any]], batch: dict[str, Any]
    ) -> None:
        self.service, self.name, self.calls, self.batch = service, name, calls, batch
        self.spans: list[Span | None] = []

    def __enter__(self) -> BatchSpans:
        tracer_ = tracer(self.service)
        if not enabled():
            return self
        start = time.time_ns()
        for session, call in self.calls:
            parent = extract(call.trace)
            if parent is None:  # the router does not trace this request
                self.spans.append(None)
                continue
            span = tracer_.start_span(
                self.name,
                context=parent,
                kind=SpanKind.SERVER,
                start_time=start,
                attributes={**self.batch, **call_attributes(session, call)},
            )
            self.spans.append(span)
        live = [span for span in self.spans if span is not None]
        for span in live:
            for other in live:
                if other is not span:
                    span.add_link(other.get_span_context(), {"dsbd.link": "same_batch"})
        return self

    def finish(self, report: Any, results: Sequence[Any], describe: Callable[[Any], dict]) -> None:
        """After the forward: the batch's report (a `SideReport`: sizes, seconds) and each
        call's result, described by `describe` (or the exception that call got)."""
        if not any(self.spans):
            return  # not tracing: nothing is computed
        batch = batch_attributes(report)
        for span, result in zip(self.spans, results, strict=True):
            if span is None:
                continue
            span.set_attributes(batch)
            if isinstance(result, BaseException):
                fail(span, result)
            else:
                span.set_attributes(describe(result))

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        for span in self.spans:
            if span is None:
                continue
            if error is not None:
                fail(span, error)
            span.end()


# --------------------------------------------------------------------------- attributes
def call_attributes(session: str, call: Any) -> dict[str, Any]:
    """What a replica span says about the call it serves (an `IterationCall`)."""
    state, config = call.state, call.config
    depth = int(state.depth.max()) if state.depth is not None else 0
    return {
        "dsbd.session": session,
        "dsbd.iteration": int(state.iteration),
        "dsbd.width": int(config.width),
        "dsbd.draft_width": int(config.effective_draft_width),
        "dsbd.depth": depth,
        "dsbd.beams": int(state.alive.sum()),
    }


def batch_attributes(report: Any) -> dict[str, Any]:
    """What a replica span says about the forward that served it (a `SideReport`)."""
    return {
        "dsbd.batch.sessions": int(report.batch.sessions),
        "dsbd.batch.forwards": int(report.batch.forwards),
        "dsbd.batch.cache_hits": int(report.batch.reused),
        "dsbd.batch.seconds": float(report.seconds),
    }


def forest_attributes(forest: Any) -> dict[str, Any]:
    """What a draft span says about the forest it proposed (one session's `Forest`)."""
    nodes = [int(layer.exists[0].sum()) for layer in forest.layers]
    return {
        "dsbd.forest.layers": len(nodes),
        "dsbd.forest.nodes": nodes,
        "dsbd.draft_tokens_proposed": sum(nodes),
    }
