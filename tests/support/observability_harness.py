"""What tests/serving/test_observability.py and tests/serving/test_observability_inprocess.py share:
the prompt they decode, and the loopback OTLP/HTTP receiver the served spans are exported to (Serve
replicas are separate processes, so an in-memory exporter in the test process would see none of
them).
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PROMPT = "What is the capital of France?"


# ------------------------------------------------------------------------ OTLP receiver
class Receiver(ThreadingHTTPServer):
    """A loopback OTLP/HTTP trace receiver: keeps every span with its resource attributes."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attributes": _attributes(span.attributes),
                            "resource": resource,
                            "links": [
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ],
                            "status": span.status.code,
                        }
                    )
        with self.server.lock:
            self.server.spans.extend(spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


def _attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        value = pair.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[pair.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[pair.key] = getattr(value, kind) if kind else None
    return out
