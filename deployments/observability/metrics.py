"""Prometheus metrics of the serving path, through Ray Serve's metrics API.

Recorded in the router (the one place that sees every iteration's verified outcome), from the
same numbers a request's returned statistics are made of (`IterationSample`), so over any
interval the counters equal the sums of the stats of the requests served in it (and
`num_draft_tokens`, which no stats field holds, the sum of their draft spans'
`dsbd.draft_tokens_proposed`).

How they reach Prometheus (Ray 2.60, read in its source and checked here): a
`ray.serve.metrics` metric is recorded in the replica's core worker and reported to the
metrics agent of its node (part of the Ray dashboard agent, which runs on every node even with
`include_dashboard=False`), which serves all of them on the node's metrics export port at
`/metrics`, each name prefixed `ray_` and counters suffixed `_total`:
`dsbd_spec_decode_num_drafts` is scraped as `ray_dsbd_spec_decode_num_drafts_total`. Serve adds
the tags `deployment`, `replica` and `application`. `dsbd serve --metrics-port` chooses the port
(default: a free one, printed and written to `--ready-file`); on a loopback-only local Ray the
agent binds it to 127.0.0.1. Reports flow every `RAY_metrics_report_interval_ms` (10 s by
default). Ray reconstructs a histogram's `_sum` from bucket midpoints, so sums of the latency
histograms are approximate; the width buckets sit at half-integers, which makes the midpoint of
each integer width's bucket the width itself and `dsbd_width_sum` exact.

Names follow vLLM's speculative-decoding metrics (vllm/v1/spec_decode/metrics.py) where they
mean the same, so vLLM's queries carry over: acceptance rate = num_accepted_tokens /
num_draft_tokens, where num_draft_tokens counts every draft token proposed (all forest nodes,
also those in layers after the first rejected one, as vLLM counts the tokens after the first
rejection). What only a draft *forest* has, the draft tokens verification actually reached,
gets its own name (`dsbd_spec_decode_num_verified_draft_tokens`), never vLLM's.
docs/SERVING.md ("Observability") says precisely what each counts and where
`num_accepted_tokens_per_pos` differs from vLLM's with more than one beam.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from dsbd_core.algorithm.engine import Outcome

NUM_DRAFTS = "dsbd_spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "dsbd_spec_decode_num_draft_tokens"
NUM_VERIFIED_DRAFT_TOKENS = "dsbd_spec_decode_num_verified_draft_tokens"
NUM_ACCEPTED_TOKENS = "dsbd_spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "dsbd_spec_decode_num_accepted_tokens_per_pos"
GENERATED_TOKENS = "dsbd_generated_tokens"
REQUESTS = "dsbd_requests"
WIDTH = "dsbd_width"
REQUEST_LATENCY = "dsbd_request_latency_s"
ITERATION_LATENCY = "dsbd_iteration_latency_s"
TIME_TO_FIRST_TOKEN = "dsbd_time_to_first_token_s"
OPEN_SESSIONS = "dsbd_open_sessions"

COUNTERS = (
    NUM_DRAFTS,
    NUM_DRAFT_TOKENS,
    NUM_VERIFIED_DRAFT_TOKENS,
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    GENERATED_TOKENS,
    REQUESTS,
)
HISTOGRAMS = (WIDTH, REQUEST_LATENCY, ITERATION_LATENCY, TIME_TO_FIRST_TOKEN)
GAUGES = (OPEN_SESSIONS,)
METRIC_NAMES = COUNTERS + HISTOGRAMS + GAUGES

# Half-integer edges: an integer width w falls in (w - 0.5, w + 0.5], whose midpoint is w.
WIDTH_BUCKETS = [k + 0.5 for k in range(17)] + [32.5, 64.5, 128.5]
REQUEST_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600]
ITERATION_BUCKETS = [0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
FIRST_TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 60]


def prometheus_name(name: str) -> str:
    """The name a metric of METRIC_NAMES is scraped under from Ray's export port."""
    return f"ray_{name}_total" if name in COUNTERS else f"ray_{name}"


@dataclass(frozen=True)
class IterationSample:
    """What one verified iteration adds to a request's statistics (row `row` of the outcome).

    The sums over a request's iterations are its `DecodeStats`: `verified_draft_tokens` ->
    `drafted_tokens`, `accepted_tokens`, `generated_tokens` -> `tokens_emitted`,
    `accepted_layers` and `widths` per iteration. `draft_tokens` (every node of the forest)
    has no `DecodeStats` field; per iteration it equals the draft span's
    `dsbd.draft_tokens_proposed`.
    """

    draft_tokens: int  # draft tokens proposed: every node of the forest (vLLM's meaning)
    verified_draft_tokens: int  # of those, the ones verification reached (a live parent, a
    # layer up to the first rejected one): what `DecodeStats.drafted_tokens` counts
    accepted_tokens: int  # of those, accepted
    accepted_layers: int  # forest layers that passed verification
    generated_tokens: int  # decoding steps the beams advanced (bonus/fallback layer included)
    widths: tuple[int, ...]  # the verified width K of every verified layer

    @property
    def drafted(self) -> bool:
        """Whether the iteration verified a draft forest (vLLM's "draft")."""
        return bool(self.widths)

    @classmethod
    def from_outcome(cls, outcome: Outcome, row: int = 0) -> IterationSample:
        return cls(
            draft_tokens=int(outcome.counters["proposed"][row]),
            verified_draft_tokens=int(outcome.counters["drafted"][row]),
            accepted_tokens=int(outcome.counters["accepted"][row]),
            accepted_layers=int(outcome.record["accepted_layers"][row]),
            generated_tokens=int(outcome.emitted[row]),
            widths=tuple(int(w) for w in outcome.record["widths"][row].tolist() if w >= 0),
        )

    def attributes(self) -> dict[str, Any]:
        """Span attributes (deployments/observability/tracing.py)."""
        return {
            "dsbd.draft_tokens": self.draft_tokens,
            "dsbd.verified_draft_tokens": self.verified_draft_tokens,
            "dsbd.accepted_tokens": self.accepted_tokens,
            "dsbd.accepted_layers": self.accepted_layers,
            "dsbd.tokens": self.generated_tokens,
            "dsbd.widths": list(self.widths),
        }


class ServingMetrics:
    """The metrics of METRIC_NAMES as Ray Serve metrics; one per process (`serving_metrics`)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        def counter(name: str, description: str, tags: tuple[str, ...] = ()) -> Any:
            return metrics.Counter(name, description=description, tag_keys=tags or None)  # type: ignore[arg-type]  # Ray annotates tag_keys as a 1-tuple

        def histogram(name: str, description: str, buckets: list[float]) -> Any:
            return metrics.Histogram(name, description=description, boundaries=buckets)

        self.drafts = counter(NUM_DRAFTS, "Iterations that verified a draft forest.")
        self.draft_tokens = counter(
            NUM_DRAFT_TOKENS,
            "Draft tokens proposed: every node of the draft forests sent to "
            "verification (those after the first rejected layer included, as vLLM counts).",
        )
        self.verified_draft_tokens = counter(
            NUM_VERIFIED_DRAFT_TOKENS,
            "Draft tokens verification reached: forest nodes with a "
            "live parent in the layers up to the first rejected one.",
        )
        self.accepted_tokens = counter(NUM_ACCEPTED_TOKENS, "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            NUM_ACCEPTED_TOKENS_PER_POS,
            "Iterations whose draft layer `position` (0 = first) "
            "passed verification (one beam: vLLM's accepted tokens per position).",
            ("position",),
        )
        self.generated = counter(GENERATED_TOKENS, "Decoding steps the beams advanced.")
        self.requests = counter(
            REQUESTS,
            "Decode requests by decoding method, HTTP status and served model.",
            ("method", "status", "model"),
        )
        self.width = histogram(WIDTH, "Verified width K of each verified layer.", WIDTH_BUCKETS)
        self.request_latency = histogram(
            REQUEST_LATENCY,
            "Decode request seconds, to the last byte (status < 400).",
            REQUEST_BUCKETS,
        )
        self.iteration_latency = histogram(
            ITERATION_LATENCY, "Router seconds per iteration (draft + verify).", ITERATION_BUCKETS
        )
        self.first_token = histogram(
            TIME_TO_FIRST_TOKEN,
            "Seconds from the request to its first generated token.",
            FIRST_TOKEN_BUCKETS,
        )
        self.open_sessions = metrics.Gauge(
            OPEN_SESSIONS, description="Decodes in progress in this router replica."
        )
        self._open = 0
        self._lock = threading.Lock()

    def iteration(self, sample: IterationSample, seconds: float) -> None:
        if sample.drafted:
            self.drafts.inc(1)
        if sample.draft_tokens:
            self.draft_tokens.inc(sample.draft_tokens)
        if sample.verified_draft_tokens:
            self.verified_draft_tokens.inc(sample.verified_draft_tokens)
        if sample.accepted_tokens:
            self.accepted_tokens.inc(sample.accepted_tokens)
        for position in range(sample.accepted_layers):
            self.accepted_per_pos.inc(1, tags={"position": str(position)})
        if sample.generated_tokens:
            self.generated.inc(sample.generated_tokens)
        for width in sample.widths:
            self.width.observe(width)
        self.iteration_latency.observe(seconds)

    def request(self, method: str, status: int, seconds: float, model: str = "none") -> None:
        self.requests.inc(1, tags={"method": method, "status": str(status), "model": model})
        if status < 400:
            self.request_latency.observe(seconds)

    def first_token_after(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def session_opened(self, change: int = 1) -> None:
        with self._lock:
            self._open += change
            self.open_sessions.set(self._open)

    def session_closed(self) -> None:
        self.session_opened(-1)


_metrics: ServingMetrics | None = None
_metrics_lock = threading.Lock()


def serving_metrics() -> ServingMetrics:
    """This process's metrics, created at first use (in the replica, where Serve tags them)."""
    global _metrics
    if _metrics is None:
        with _metrics_lock:
            if _metrics is None:
                _metrics = ServingMetrics()
    return _metrics
