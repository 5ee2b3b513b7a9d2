"""Spans and metrics: the request and session observers (`observers`), OpenTelemetry
(`tracing`) and Prometheus metrics (`metrics`)."""
