"""Tracing and metrics of the serving path, checked where they really go.

Serve replicas are separate processes, so an in-memory exporter in this process would see none
of their spans. The end-to-end tests therefore run what a user runs: `dsbd serve` (tiny real
models) with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP receiver in this test (a
loopback HTTP server decoding `ExportTraceServiceRequest` protobufs with opentelemetry-proto),
and scrape the Prometheus endpoint of Ray's metrics agent that `dsbd serve` reports. Spans must
form one trace per request across the ingress, router, draft and verifier processes, continuing the
client's `traceparent`; the counters must equal the sums of the requests' returned stats
(the proposed draft tokens, which the stats do not hold: the sums of the draft spans' counts).

The pure pieces (what an iteration adds to the stats, span attributes, batch links, W3C
propagation, "no endpoint, no exporter") are checked in-process with the SDK's in-memory
exporter, in tests/serving/test_observability_inprocess.py.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deployments.observability.metrics import METRIC_NAMES, prometheus_name
from dsbd import server_process
from tests.support.observability_harness import PROMPT, Receiver
from tests.support.tiny_models import build_pair

KNOBS = {
    "method": "dsbd",
    "width": 2,
    "gamma": 3,
    "threshold": 0.6,
    "max_new_tokens": 12,
    "adaptive": False,
}


# ------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory):
    """`dsbd serve` exporting spans to a receiver here; the requests every test looks at."""
    root = tmp_path_factory.mktemp("observed")
    target, draft = build_pair(root / "models")
    small = {"num_cpus": 0.1}
    models = {
        "target": {"source": str(target), "dtype": "float64"},
        "draft": {"source": str(draft), "dtype": "float64"},
    }
    config = {
        "applications": [
            {
                "name": "dsbd",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "args": {
                    "model_name": "tiny",
                    **models,
                    "router_resources": small,
                    "draft_resources": small,
                    "verifier_resources": small,
                },
            }
        ]
    }
    (root / "serve.yaml").write_text(yaml.safe_dump(config))
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # export within 0.2 s (default 5 s)
        "RAY_metrics_report_interval_ms": "1000",
    }
    try:
        server = server_process.start(
            root, root / "serve.yaml", num_cpus=4, env=env, timeout_s=300, exit_on_sigterm=False
        )
    except server_process.ServerStartError as error:
        pytest.fail(str(error))
    try:
        url = server.url
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
        alone = _generate(url, {**KNOBS, "seed": 1}, headers)
        with ThreadPoolExecutor(4) as pool:  # concurrent: their calls share forwards
            together = list(
                pool.map(
                    lambda s: _generate(url, {**KNOBS, "seed": s, "max_new_tokens": 24}),
                    range(2, 6),
                )
            )
        for body in (
            {"prompt": PROMPT, "method": "dsbd", "width": 0},  # refused by the schema
            {"prompt_ids": [10**6], "method": "beam"},
        ):  # refused by the router's checks
            refused = requests.post(f"{url}/v1/dsbd/generate", json=body, timeout=60)
            assert refused.status_code == 400, refused.text
        yield {
            "url": url,
            "metrics_url": server.ready["metrics_url"],
            "receiver": receiver,
            "trace_id": trace_id,
            "client_span": client_span,
            "alone": alone,
            "together": together,
            "log": server.log,
        }
    finally:
        assert not server_process.stop(server), "the server left processes behind"
        receiver.shutdown()


def _generate(url: str, body: dict, headers: dict | None = None) -> dict:
    response = requests.post(
        f"{url}/v1/dsbd/generate", json={"prompt": PROMPT, **body}, headers=headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for(check: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.25)


# ------------------------------------------------------------------------ traces
def test_a_request_is_one_trace_from_the_client_to_draft_and_verifier(observed) -> None:
    stats = observed["alone"]["stats"]
    serving, iterations = stats["serving"], stats["iterations"]
    drafted_at = [i for i, widths in enumerate(stats["widths"]) if widths]  # a forest verified
    drafted = len(drafted_at)
    expected = 1 + 2 * iterations + drafted  # request, iterations, verifies, drafts

    spans = _wait_for(
        lambda: (
            (s := observed["receiver"].trace(observed["trace_id"])) and len(s) >= expected and s
        ),
        f"{expected} spans of the traced request",
    )
    by_name = defaultdict(list)
    for span in spans:
        by_name[span["name"]].append(span)
    assert {k: len(v) for k, v in by_name.items()} == {
        "dsbd.request": 1,
        "dsbd.iteration": iterations,
        "dsbd.verify": iterations,
        "dsbd.draft": drafted,
    }

    # the client's span -> request (ingress) -> iteration (router) -> draft / verify (replicas)
    (request,) = by_name["dsbd.request"]
    assert request["parent"] == observed["client_span"]
    assert request["resource"]["service.name"] == "dsbd-ingress"
    assert request["attributes"]["dsbd.session"] == serving["session"]
    assert request["attributes"]["dsbd.method"] == "dsbd"
    assert request["attributes"]["http.response.status_code"] == 200
    assert request["attributes"]["dsbd.iterations"] == iterations
    assert request["attributes"]["dsbd.tokens"] == stats["tokens_emitted"]
    iterations_by_index = {}
    for span in by_name["dsbd.iteration"]:
        assert span["parent"] == request["span_id"]
        assert span["resource"]["service.name"] == "dsbd-router"
        iterations_by_index[span["attributes"]["dsbd.iteration"]] = span
    assert sorted(iterations_by_index) == list(range(iterations))
    for index, span in iterations_by_index.items():
        attributes = span["attributes"]
        assert attributes["dsbd.accepted_layers"] == stats["accepted_layers"][index]
        assert attributes["dsbd.widths"] == stats["widths"][index]
        assert attributes["dsbd.gamma"] == serving["gamma"][index]
        assert attributes["dsbd.verifier.replica"] == serving["verify_replica"][index]

    for side, service, replicas in (
        ("verify", "dsbd-verifier", serving["verify_replica"]),
        ("draft", "dsbd-draft", serving["draft_replica"]),
    ):
        children = {}
        for span in by_name[f"dsbd.{side}"]:
            parent = next(s for s in iterations_by_index.values() if s["span_id"] == span["parent"])
            index = parent["attributes"]["dsbd.iteration"]
            assert index not in children, f"two {side} spans under iteration {index}"
            children[index] = span
            attributes = span["attributes"]
            assert span["resource"]["service.name"] == service
            assert span["resource"]["service.instance.id"] == attributes["dsbd.replica"]
            assert attributes["dsbd.session"] == serving["session"]
            assert attributes["dsbd.iteration"] == index
            assert attributes["dsbd.batch.requests"] >= 1
        assert sorted(children) == (list(range(iterations)) if side == "verify" else drafted_at)
        assert [children[i]["resource"]["service.instance.id"] for i in sorted(children)] == (
            replicas
        )
        if side == "verify":
            for index, span in children.items():
                assert span["attributes"]["dsbd.accepted_layers"] == stats["accepted_layers"][index]
                assert span["attributes"]["dsbd.widths"] == stats["widths"][index]
        else:
            for index, span in children.items():
                attributes = span["attributes"]
                assert 1 <= attributes["dsbd.forest.layers"] == attributes["dsbd.depth"]
                assert attributes["dsbd.depth"] <= serving["gamma"][index]
                # the router's count of proposed draft tokens is the draft's own
                router_side = iterations_by_index[index]["attributes"]
                assert router_side["dsbd.draft_tokens"] == attributes["dsbd.draft_tokens_proposed"]
    processes = {span["resource"]["service.instance.id"] for span in spans}
    assert len(processes) == 4, processes  # ingress, router, draft and verifier replicas


def test_calls_batched_into_one_forward_link_to_each_other(observed) -> None:
    sessions = {r["stats"]["serving"]["session"] for r in observed["together"]}
    shared = sum(
        n > 1 for r in observed["together"] for n in r["stats"]["serving"]["verify_batch_requests"]
    )
    assert shared, "the concurrent requests never shared a verifier forward"

    def verify_spans() -> list[dict[str, Any]]:
        with observed["receiver"].lock:
            spans = list(observed["receiver"].spans)
        return [
            s
            for s in spans
            if s["name"] == "dsbd.verify" and s["attributes"]["dsbd.session"] in sessions
        ]

    total = sum(r["stats"]["iterations"] for r in observed["together"])
    spans = _wait_for(lambda: len(s := verify_spans()) == total and s, "the verify spans")
    batches = defaultdict(list)
    for span in spans:
        batches[span["attributes"]["dsbd.batch.id"]].append(span)
    joint = [b for b in batches.values() if len(b) > 1]
    assert joint, "no two verify spans carry the same batch id"
    for batch in joint:
        assert len({s["trace_id"] for s in batch}) == len(batch)  # one call per request
        for span in batch:
            assert span["attributes"]["dsbd.batch.requests"] == len(batch)
            others = {(s["trace_id"], s["span_id"]) for s in batch if s is not span}
            assert set(span["links"]) == others


# ------------------------------------------------------------------------ metrics
def _scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(requests.get(url, timeout=30).text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _total(samples: dict, name: str, **labels: str) -> float:
    matching = [v for tags, v in samples.get(name, []) if labels.items() <= tags.items()]
    return sum(matching)


def test_prometheus_counters_equal_the_sums_of_the_returned_stats(observed) -> None:
    url = observed["metrics_url"]
    assert url.startswith("http://127.0.0.1:"), url
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert _listening_addresses(port) == {"127.0.0.1"}, "the metrics port listens beyond loopback"

    served = [observed["alone"], *observed["together"]]
    stats = [r["stats"] for r in served]
    iterations = sum(s["iterations"] for s in stats)
    requests_total = prometheus_name("dsbd_requests")

    def unexported(s: dict) -> list[str]:
        families = [prometheus_name(name) for name in METRIC_NAMES]
        return [f for f in families if not any(key.startswith(f) for key in s)]

    def exported(s: dict) -> bool:
        """Both processes that count have reported: the ingress counts requests, the router
        counts iterations (and the draft counters, in the same report); each reports on its
        own schedule, so one scrape can hold the first's final counts and not the second's.
        Ray's agent drops a gauge whose last report is older than two report intervals (2 s
        here), which a loaded machine's late report exceeds: a scrape counts once it holds
        every family, the open-sessions gauge included."""
        return (
            _total(s, requests_total) >= len(served) + 2
            and _total(s, "ray_dsbd_iteration_latency_s_count") >= iterations
            and not unexported(s)
        )

    samples = _wait_for(
        lambda: (s := _scrape(url)) and exported(s) and s,
        "the ingress and the router to report",
        timeout=40,
    )
    assert _total(samples, requests_total, method="dsbd", status="200") == len(served)
    # before the handler knew the method (schema) / after (the router's own checks)
    assert _total(samples, requests_total, method="none", status="400") == 1
    assert _total(samples, requests_total, method="beam", status="400") == 1

    def counter(name: str, **labels: str) -> float:
        return _total(samples, prometheus_name(name), **labels)

    drafts = sum(sum(1 for w in s["widths"] if w) for s in stats)
    assert counter("dsbd_spec_decode_num_drafts") == drafts
    # vLLM's num_draft_tokens: every draft token proposed, as the draft replicas' own spans
    # count them (the returned stats count only those verification reached)
    sessions = {s["serving"]["session"] for s in stats}

    def draft_spans() -> list[dict[str, Any]]:
        with observed["receiver"].lock:
            spans = list(observed["receiver"].spans)
        return [
            s
            for s in spans
            if s["name"] == "dsbd.draft" and s["attributes"]["dsbd.session"] in sessions
        ]

    spans = _wait_for(lambda: len(s := draft_spans()) == drafts and s, "the draft spans")
    proposed = sum(span["attributes"]["dsbd.draft_tokens_proposed"] for span in spans)
    assert counter("dsbd_spec_decode_num_draft_tokens") == proposed
    verified = sum(s["drafted_tokens"] for s in stats)
    assert counter("dsbd_spec_decode_num_verified_draft_tokens") == verified
    assert proposed >= verified >= sum(s["accepted_tokens"] for s in stats) > 0
    assert counter("dsbd_spec_decode_num_accepted_tokens") == sum(
        s["accepted_tokens"] for s in stats
    )
    deepest = max(len(s["accepted_per_position"]) for s in stats)
    for position in range(deepest + 1):
        want = sum(
            s["accepted_per_position"][position]
            for s in stats
            if position < len(s["accepted_per_position"])
        )
        got = counter("dsbd_spec_decode_num_accepted_tokens_per_pos", position=str(position))
        assert got == want, f"position {position}"
    assert counter("dsbd_generated_tokens") == sum(s["tokens_emitted"] for s in stats)

    widths = [w for s in stats for layer in s["widths"] for w in layer]
    assert _total(samples, "ray_dsbd_width_count") == len(widths)
    assert _total(samples, "ray_dsbd_width_sum") == pytest.approx(sum(widths))
    assert _total(samples, "ray_dsbd_width_bucket", le="1.5") == sum(w <= 1 for w in widths)
    assert _total(samples, "ray_dsbd_iteration_latency_s_count") == iterations
    assert _total(samples, "ray_dsbd_time_to_first_token_s_count") == len(served)
    assert _total(samples, "ray_dsbd_request_latency_s_count") == len(served)
    assert _total(samples, "ray_dsbd_open_sessions") == 0
    assert not unexported(samples), f"{unexported(samples)} not exported"


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                if len(address) == 8:
                    found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.add("::" if int(address, 16) == 0 else address)
    return found
