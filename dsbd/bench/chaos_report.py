"""What a chaos run's records say (`dsbd bench chaos`): the run's settings and records (kept
here, so that the report reads them without importing the driver), the summary it reports, the
seeded requests decoded again in-process with the server's models, and the plot of latency over
time with the kills marked."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dsbd.bench.load import ABANDONED, Record, percentiles

SIDES = ("router", "draft", "verifier")  # the deployments whose replicas may be killed
# and Ray's GCS (`--kill gcs`: the server then keeps the GCS's tables in a Redis the bench starts)
KILLABLE = (*SIDES, "gcs")


@dataclass
class ChaosConfig:
    """One chaos run's settings (the flags of `dsbd bench chaos`)."""

    clients: int = 32
    duration_s: float = 600.0
    kill_every_s: tuple[float, float] = (30.0, 60.0)
    first_kill_s: float | None = None  # default: a draw from kill_every_s
    quiet_tail_s: float = 60.0
    max_kills: int | None = None
    targets: tuple[str, ...] = SIDES
    seed: int = 0
    max_tokens: int = 8
    seeded_share: float = 0.25
    request_timeout_s: float = 300.0
    recovery_timeout_s: float = 180.0
    client_retries: int = 2  # what the openai client retries by default (chaos.attempt)


@dataclass
class Kill:
    """One SIGKILLed replica and its recovery."""

    side: str
    pid: int
    at_s: float
    recovered_s: float | None = None  # seconds from the kill to recovery (None: not in time)
    outage_s: float | None = None  # the GCS: seconds until a new GCS process listened again
    new_pid: int | None = None
    probe_status: int | None = None


@dataclass
class Run:
    """What a chaos run records while it runs: every request, retry, hand-over and kill."""

    url: str
    model: str
    server_pid: int
    t0: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    retries: list[int] = field(default_factory=list)  # per native response: retried iterations
    retry_causes: list[str] = field(default_factory=list)
    handovers: list[int] = field(default_factory=list)  # per native response: to a new router
    seeded: list[dict[str, Any]] = field(default_factory=list)  # body + beams returned
    kills: list[Kill] = field(default_factory=list)
    client_retried: list[Record] = field(default_factory=list)  # attempts a client retried
    stop_at: float = 0.0  # monotonic: when the clients stop (the killer may push it later)

    def now(self) -> float:
        return time.monotonic() - self.t0


def phase(record: Record, run: Run) -> str:
    """before the first kill, during (first kill to last recovery), after."""
    if not run.kills:
        return "before"
    first = run.kills[0].at_s
    last = run.kills[-1].at_s + (run.kills[-1].recovered_s or 0.0)
    return "before" if record.start_s < first else "during" if record.start_s < last else "after"


def cause(record: Record, run: Run) -> str:
    """What a failure overlapped: the kill during the request's lifetime, if any."""
    end = record.start_s + record.latency_s
    during = [
        k for k in run.kills if record.start_s <= k.at_s + (k.recovered_s or 0) and k.at_s <= end
    ]
    where = f"{during[0].side} kill at {during[0].at_s} s" if during else "no kill in flight"
    return f"{record.status} ({where}): {(record.error or '')[:120]}"


def summarise(run: Run, config: ChaosConfig, extra: dict[str, Any]) -> dict[str, Any]:
    records = run.records
    ok = [r for r in records if r.status == 200]
    failed = [r for r in records if r.status not in (200, ABANDONED)]
    by_status: dict[str, int] = {}
    for r in failed:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    recoveries = [k.recovered_s for k in run.kills]
    latency = {
        name: percentiles([r.latency_s for r in ok if phase(r, run) == name])
        for name in ("before", "during", "after")
    }
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": asdict(config),
        "model": run.model,
        "duration_s": config.duration_s,
        "clients": config.clients,
        "kills": len(run.kills),
        "sent": len(records),
        "completed": len(ok),
        "abandoned": sum(1 for r in records if r.status == ABANDONED),
        "failed": len(failed),
        "status_5xx": sum(1 for r in records if 500 <= r.status < 600),
        # every 5xx the server answered, those a client then retried included
        "status_5xx_answered": sum(
            1 for r in [*records, *run.client_retried] if 500 <= r.status < 600
        ),
        "retries": sum(run.retries),  # iterations the server retried (a replica lost)
        "native_responses": len(run.retries),
        "native_responses_with_retries": sum(1 for n in run.retries if n),
        # native decodes the ingress handed to another router after theirs was killed
        "native_responses_with_handovers": sum(1 for n in run.handovers if n),
        "client_retries": len(run.client_retried),  # requests a client sent again (`attempt`)
        "client_retried_by_status": dict(Counter(str(r.status) for r in run.client_retried)),
        "client_retry_causes": sorted({cause(r, run) for r in run.client_retried})[:20],
        "max_recovery_s": max((r for r in recoveries if r is not None), default=None),
        "all_recovered": all(r is not None for r in recoveries),
        "failed_by_status": by_status,
        "failed_causes": sorted({cause(r, run) for r in failed})[:20],
        "retry_causes": sorted(set(run.retry_causes))[:20],
        "kill_log": [asdict(k) for k in run.kills],
        "latency_s": {"all": percentiles([r.latency_s for r in ok]), **latency},
        **extra,
        "requests": [asdict(r) for r in records],
    }


def compare_seeded(app: Any, seeded: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode every seeded request in-process with the server's models, loaded as its replicas
    load them, and compare the beams (token ids; log-likelihoods within 1e-6). Equal where the
    numerics do not depend on the batch (`batch_invariant_numerics`: bfloat16, the int8 draft,
    float64), a lost cache (`cache_lost`) included: it is replayed, not re-prefilled."""
    import torch

    from dsbd_core import SamplingConfig
    from dsbd_core.algorithm.drivers.decoders import generate
    from dsbd_core.models import load_tokenizer
    from dsbd_core.models.dtypes import resolve_dtype
    from dsbd_core.models.pair import load_pair
    from dsbd_core.models.transformer_scorer import TransformerScorer

    target, draft = app.target, app.draft
    if resolve_dtype(target.dtype, target.device)[0] != resolve_dtype(draft.dtype, draft.device)[0]:
        return {"compared": 0, "why": "target.dtype and draft.dtype differ: load_pair loads one"}
    torch.set_num_threads(target.threads)
    pair = load_pair(
        target.source,
        draft.source,
        dtype=target.dtype,
        device=target.device,
        draft_options=draft.variant,
    )
    assert pair.draft is not None
    _, stop_ids = load_tokenizer(target.source)
    same, differ, worst = 0, [], 0.0
    lost = {"compared": 0, "equal": 0}  # a cache lost (retried, or moved): replayed
    for item in seeded:
        body = item["body"]
        knobs = {k: v for k, v in body.items() if k not in ("prompt_ids", "adaptive")}
        want = generate(
            "dsbd",
            TransformerScorer(pair.target.model),
            body["prompt_ids"],
            SamplingConfig(eos_token_ids=stop_ids, **knobs),
            draft=TransformerScorer(pair.draft.model),
        )
        got = item["beams"]
        equal = [b.token_ids for b in want.beams] == [b["token_ids"] for b in got]
        lost["compared"] += item["cache_lost"]
        lost["equal"] += item["cache_lost"] and equal
        if equal:
            same += 1
            for a, b in zip(want.beams, got, strict=True):
                worst = max(worst, abs(a.log_likelihood - b["log_likelihood"]))
        else:
            differ.append(body)
    # float32 matmuls round with the batch (docs/SERVING.md "Seeded decodes and numerics")
    invariant = pair.dtype_name in ("bfloat16", "float64")
    return {
        "compared": len(seeded),
        "equal": same,
        "different": len(differ),
        "cache_lost": lost,
        "different_examples": differ[:5],
        "max_log_likelihood_difference": worst,
        "models": pair.describe(),
        "batch_invariant_numerics": invariant,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Latency over time (each request at its start), failures in red, kills as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    records = results["requests"]
    for status, style, label in ((200, "o", "completed"), (None, "x", "failed")):
        chosen = [
            r
            for r in records
            if (r["status"] == 200) == (status == 200) and r["status"] != ABANDONED
        ]
        ax.plot(
            [r["start_s"] for r in chosen],
            [r["latency_s"] for r in chosen],
            style,
            markersize=3,
            alpha=0.6,
            label=label,
            color=None if status else "red",
        )
    for kill in results["kill_log"]:
        colour = {"router": "purple", "draft": "tab:orange", "verifier": "tab:green"}.get(
            kill["side"], "tab:red"
        )
        ax.axvline(kill["at_s"], color=colour, linestyle="--")
        if kill["recovered_s"] is not None:
            ax.axvspan(kill["at_s"], kill["at_s"] + kill["recovered_s"], color=colour, alpha=0.1)
        ax.annotate(
            f"kill {kill['side']}",
            (kill["at_s"], 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=colour,
        )
    ax.set(xlabel="request start (s into the run)", ylabel="latency (s)")
    title = (
        f"chaos: {results['clients']} clients, {results['kills']} kills, "
        f"{results['failed']} failed of {results['sent']} ({results['model']})"
    )
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
