"""The Grafana dashboard of the cluster files (cluster/grafana/), checked offline against what
reads it.

* the dashboard's queries against the metric names Ray 2.60 really exports (checked in
  Ray's exporter: a `ray_` prefix, `_total` on counters, `_bucket/_sum/_count` on histograms)
  and, where promtool is installed (CI installs it), against Prometheus' own PromQL parser.

Split from tests/cluster/test_cluster.py (the KubeRay manifests and the VM cluster config).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
DASHBOARD = CLUSTER / "grafana" / "dsbd-dashboard.json"

# Ray Serve's own metrics the dashboard shows (names as created in ray/serve/_private).
SERVE_METRICS = {
    "serve_deployment_replica_healthy": "gauge",
    "serve_autoscaling_target_replicas": "gauge",
    "serve_replica_processing_queries": "gauge",
    "serve_deployment_request_counter": "counter",
    "serve_deployment_processing_latency_ms": "histogram",
    "serve_deployment_error_counter": "counter",
    "serve_deployment_queued_queries": "gauge",
}
# What Ray 2.60's Prometheus exporter (OpenTelemetry) appends to a metric's `ray_<name>`.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$application": ".*"}


# ------------------------------------------------------------------------------- the dashboard
def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['id']} {panel['title']!r}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append((f"variable {variable['name']}", variable["query"]["query"]))
    return queries


def dsbd_metrics() -> dict[str, str]:
    """The metrics dsbd exports through ray.serve.metrics, by kind, from the one list the
    metrics code keeps (deployments/observability/metrics.py): the dashboard may use no other
    dsbd name."""
    from deployments.observability import metrics

    kinds = {
        **{name: "counter" for name in metrics.COUNTERS},
        **{name: "histogram" for name in metrics.HISTOGRAMS},
        **{name: "gauge" for name in metrics.GAUGES},
    }
    assert set(kinds) == set(metrics.METRIC_NAMES)
    return kinds


def metric_kind(series: str) -> tuple[str, str] | None:
    """(catalogue name, kind) of a `ray_...` series name as Ray exports it, or None."""
    name = series.removeprefix("ray_")
    for catalogue in (dsbd_metrics(), SERVE_METRICS):
        for metric, kind in catalogue.items():
            if any(name == metric + suffix for suffix in SUFFIXES[kind]):
                return metric, kind
    return None


def test_dashboard_uses_only_exported_metric_names() -> None:
    used: set[str] = set()
    for where, query in dashboard_queries():
        series = set(re.findall(r"\bray_[a-z0-9_]+", query))
        assert series, f"{where}: no ray_ metric in {query!r}"
        for name in series:
            found = metric_kind(name)
            assert found, f"{where}: {name} is not a metric Ray exports under that name"
            used.add(found[0])
    assert set(dsbd_metrics()) <= used, f"not on the dashboard: {set(dsbd_metrics()) - used}"
    # Serve's names, as Ray 2.60 creates them (the proxy's take a protocol: http/grpc).
    serve_source = "".join(
        p.read_text() for p in (Path(ray.__file__).parent / "serve" / "_private").glob("*.py")
    )
    for name in SERVE_METRICS:
        assert f'"{name}"' in serve_source, f"Ray Serve has no metric {name}"


def test_acceptance_rates_name_their_denominator() -> None:
    """Two acceptance rates exist: of every proposed draft token (vLLM's) and of the draft
    tokens verification reached. Each ratio of accepted tokens on the dashboard says which one
    it shows, and divides by the counter that means it."""
    accepted = "ray_dsbd_spec_decode_num_accepted_tokens_total"
    denominators = {
        "proposed": "ray_dsbd_spec_decode_num_draft_tokens_total",
        "verified": "ray_dsbd_spec_decode_num_verified_draft_tokens_total",
    }
    shown = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            numerator, _, denominator = target["expr"].partition(" / ")
            if accepted not in numerator or "draft_tokens" not in denominator:
                continue
            label = f"{panel['title']}: {target['legendFormat']}"
            kinds = [kind for kind in denominators if kind in target["legendFormat"]]
            assert len(kinds) == 1, f"{label!r} does not say which acceptance rate it is"
            assert re.findall(r"\bray_[a-z0-9_]+", denominator) == [denominators[kinds[0]]], label
            if panel["type"] == "stat":
                assert kinds[0] in panel["title"], label
            shown.add(kinds[0])
    assert shown == set(denominators)


def test_dashboard_is_a_grafana_dashboard_over_a_prometheus_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    subjects = [
        "acceptance rate",
        "position",
        "drafts per second",
        "width",
        "request latency",
        "iteration latency",
        "tokens",
        "open sessions",
        "errors",
        "replicas",
    ]
    for subject in subjects:
        assert subject in titles, subject


@pytest.mark.skipif(
    shutil.which("promtool") is None and not os.environ.get("CI"),
    reason="promtool not installed (Debian: prometheus; .ci/run installs it)",
)
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """Prometheus' own parser (promtool) on every query, Grafana's variables filled in."""
    rules = []
    for index, (_, query) in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        if query.startswith("label_values("):  # a Grafana function, not PromQL: its metric
            query = query.removeprefix("label_values(").split(",")[0]
        rules.append({"record": f"dashboard:query_{index}", "expr": query})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout
