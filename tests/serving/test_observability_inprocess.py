"""Tracing and metrics of the serving path: the pure pieces, checked in-process.

What an iteration adds to the stats, span attributes, batch links, W3C propagation and "no
endpoint, no exporter", with the SDK's in-memory exporter; the end-to-end checks (spans and
counters of a running `dsbd serve`) are in tests/serving/test_observability.py.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deployments.decode.session import accepted_per_position
from deployments.messages import IterationCall, SideReport
from deployments.observability import tracing
from deployments.observability.metrics import IterationSample
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.session_batch import BatchReport
from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.scorer import drive
from dsbd_core.models import load_causal_lm, load_tokenizer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.observability_harness import PROMPT
from tests.support.serving_harness import REPO
from tests.support.tiny_models import build_pair


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    target_dir, draft_dir = build_pair(tmp_path_factory.mktemp("tiny"))
    target = load_causal_lm(str(target_dir), dtype=torch.float64)
    draft = load_causal_lm(str(draft_dir), dtype=torch.float64)
    _, stop_ids = load_tokenizer(str(target_dir))
    return target, draft, stop_ids


def _steps(tiny, **knobs: Any):
    """An in-process decode step by step:
    (engine, [(state for the models, forest, outcome)], result)."""
    target, draft, stop_ids = tiny
    # seed 3: the dynamic-width decode rejects drafts that had children (a branch checked below)
    config = SamplingConfig(eos_token_ids=stop_ids, seed=3, **knobs)
    scorer, draft_scorer = TransformerScorer(target.model), TransformerScorer(draft.model)
    engine = Engine(method_config("dsbd", config), scorer.vocab_size)
    state = engine.start([target.tokenizer.encode(PROMPT)])
    steps = []
    while engine.next_iteration(state):
        models = state.for_models()
        forest = drive(draft_scorer, engine.propose_steps(state))
        outcome = drive(scorer, engine.verify_steps(state, forest))
        steps.append((models, forest, outcome))
        engine.advance(state, outcome)
    return engine, steps, engine.finish(state)[0]


@pytest.mark.parametrize(
    "knobs",
    [
        {"width": 3, "gamma": 3, "threshold": 0.6, "max_new_tokens": 24},
        {"width": 1, "gamma": 4, "threshold": None, "max_new_tokens": 20},
    ],
)
def test_iteration_samples_sum_to_the_request_stats(tiny, knobs) -> None:
    _, steps, result = _steps(tiny, **knobs)
    samples = [IterationSample.from_outcome(outcome) for _, _, outcome in steps]
    stats = result.stats
    # draft tokens: every node of the iteration's forest, as the draft span reports it
    proposed = [
        tracing.forest_attributes(forest)["dsbd.draft_tokens_proposed"] for _, forest, _ in steps
    ]
    assert [s.draft_tokens for s in samples] == proposed
    assert sum(s.verified_draft_tokens for s in samples) == stats.drafted_tokens
    assert all(s.draft_tokens >= s.verified_draft_tokens >= s.accepted_tokens for s in samples)
    if knobs["width"] == 1:  # one draft per layer: the chain vLLM's metrics describe
        assert [s.draft_tokens for s in samples] == [int(m.depth[0]) for m, _, _ in steps]
        assert [s.verified_draft_tokens for s in samples] == [len(s.widths) for s in samples]
        assert sum(s.accepted_layers for s in samples) == stats.accepted_tokens
    else:  # children of rejected drafts, layers past a rejected one: proposed, not verified
        assert sum(s.draft_tokens for s in samples) > stats.drafted_tokens
    assert sum(s.accepted_tokens for s in samples) == stats.accepted_tokens
    assert sum(s.generated_tokens for s in samples) == stats.tokens_emitted
    assert [s.accepted_layers for s in samples] == stats.accepted_layers
    assert [list(s.widths) for s in samples] == stats.widths
    per_position = [
        sum(s.accepted_layers > p for s in samples) for p in range(max(stats.accepted_layers))
    ]
    assert per_position == accepted_per_position(result)
    assert sum(s.drafted for s in samples) == len(samples)  # every iteration drafted here
    attributes = samples[0].attributes()
    assert attributes["dsbd.widths"] == stats.widths[0]
    assert attributes["dsbd.accepted_layers"] == stats.accepted_layers[0]


@pytest.fixture
def memory_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)


def test_batched_calls_continue_their_traces_and_link_each_other(tiny, memory_spans) -> None:
    _, steps, _ = _steps(tiny, width=2, gamma=2, threshold=None, max_new_tokens=8)
    tracer = tracing.tracer(tracing.ROUTER)
    iterations = [tracer.start_span("dsbd.iteration") for _ in range(3)]
    models, _, outcome = steps[0]
    config = method_config("dsbd", SamplingConfig(width=2, gamma=2, threshold=None))
    calls = [
        (f"s{i}", IterationCall(models, config, tracing.inject(span)))
        for i, span in enumerate(iterations)
    ]
    calls.append(("untraced", IterationCall(models, config)))  # the router did not trace
    assert all(call.trace["traceparent"].startswith("00-") for _, call in calls[:3])

    report = SideReport(BatchReport(requests=3, sessions=4, forwards=1, reused=2), "r", 0.25)
    error = RuntimeError("this call failed")
    with tracing.BatchSpans(
        tracing.VERIFIER, "dsbd.verify", calls, {"dsbd.batch.id": "r:1", "dsbd.batch.requests": 4}
    ) as batch:
        batch.finish(
            report,
            [outcome, outcome, error, outcome],
            lambda o: IterationSample.from_outcome(o).attributes(),
        )
    for span in iterations:
        span.end()

    spans = [s for s in memory_spans.get_finished_spans() if s.name == "dsbd.verify"]
    assert len(spans) == 3  # none for the untraced call
    for span, parent in zip(spans, iterations, strict=True):
        assert span.parent.span_id == parent.get_span_context().span_id
        assert span.context.trace_id == parent.get_span_context().trace_id
        others = {s.context.span_id for s in spans if s is not span}
        assert {link.context.span_id for link in span.links} == others
        assert span.attributes["dsbd.batch.id"] == "r:1"
        assert span.attributes["dsbd.batch.cache_hits"] == 2
        assert span.attributes["dsbd.depth"] == int(models.depth.max())
    assert spans[0].attributes["dsbd.accepted_layers"] == int(outcome.record["accepted_layers"][0])
    assert not spans[2].status.is_ok and spans[2].events[0].name == "exception"


def test_w3c_context_round_trips_through_headers_and_carriers(memory_spans) -> None:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = [
        (b"content-type", b"application/json"),
        (b"traceparent", f"00-{trace_id}-{span_id}-01".encode()),
    ]
    parent = tracing.extract_headers(headers)
    span = tracing.tracer(tracing.ROUTER).start_span("dsbd.request", context=parent)
    assert f"{span.get_span_context().trace_id:032x}" == trace_id
    carrier = tracing.inject(span)
    assert carrier["traceparent"].split("-")[1] == trace_id
    child = tracing.tracer(tracing.ROUTER).start_span("c", context=tracing.extract(carrier))
    assert child.parent.span_id == span.get_span_context().span_id
    assert tracing.extract_headers([(b"traceparent", b"garbage")]) is None
    assert tracing.extract({}) is None


def test_without_an_endpoint_no_exporter_exists(tmp_path: Path) -> None:
    """A fresh process: no provider, the exporter's module never imported, spans are no-ops."""
    script = (
        "import sys\n"
        "from deployments.observability import tracing\n"
        "span = tracing.tracer(tracing.ROUTER).start_span('x')\n"
        "assert not tracing.enabled() and not span.is_recording()\n"
        "assert tracing.inject(span) == {}\n"
        "assert not any('exporter' in name for name in sys.modules), 'exporter imported'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert not tracing.export_configured({})
    assert tracing.export_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.export_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h/v1/traces"})
    assert not tracing.export_configured(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}
    )
