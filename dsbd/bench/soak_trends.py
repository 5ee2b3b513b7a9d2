"""A soak's growth figures (`growth`, which `dsbd bench soak` reports per process) and saved soaks
side by side (`dsbd bench soak --trends`): each process's growth over the last window by its end
points and by the least-squares trend over all of the window's samples.

Why: the end-point figure (mean of the window's last three samples over its first three)
moves by +-2 % for a process whose live memory follows the work in flight (the verifier),
with no trend; the fit over 120 samples moves far less. This reads the `*_details` of saved
soak.json files (the slope per hour was in every one) and, from the RSS samples they keep,
the trend's standard error, so figures of earlier soaks can be put beside new ones.

    dsbd bench soak --trends benchmarks/results/soak*.json
    dsbd bench soak --trends FILE... --trends-top 4
    dsbd bench soak --trends FILE... --json
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

FIGURES = ("rss_end", "rss_trend", "pss_end", "pss_trend")


def growth(times: list[float], values: list[int], unit: float = 2**20) -> dict[str, float]:
    """A series' growth over its span: by end points (`growth`: the mean of the last three
    values over the mean of the first three, minus one) and by the least-squares line through
    all of them (`slope_per_hour`, `trend`: its rise across the span, `trend_se`), each as a
    fraction of the same start; first/last/max in MiB (`unit` 1: as counted)."""
    first = sum(values[:3]) / len(values[:3])
    last = sum(values[-3:]) / len(values[-3:])
    base = first or last or 1.0  # a series that starts at 0 (sessions, shared memory)
    mean_t, mean_v = sum(times) / len(times), sum(values) / len(values)
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True))
    slope = slope / spread if spread else 0.0  # bytes per second
    residual = sum(
        (v - mean_v - slope * (t - mean_t)) ** 2 for t, v in zip(times, values, strict=True)
    )
    # the slope's standard error with independent samples (neighbours correlate: a floor)
    slope_se = (residual / (len(values) - 2) / spread) ** 0.5 if len(values) > 2 and spread else 0
    span = times[-1] - times[0]
    tag = "_mib" if unit == 2**20 else ""
    return {
        f"first{tag}": round(first / unit, 1),
        f"last{tag}": round(last / unit, 1),
        f"max{tag}": round(max(values) / unit, 1),
        "growth": round((last - first) / base, 4),
        "max_growth": round((max(values) - first) / base, 4),
        "slope_per_hour": round(slope * 3600 / base, 4),
        "trend": round(slope * span / base, 4),
        "trend_se": round(slope_se * span / base, 4),
    }


def process_kind(name: str) -> str:
    """ "dsbd:Verifier 24880" -> "dsbd:Verifier": the same process across soaks."""
    return re.sub(r" \d+$", "", name)


def trends(path: Path) -> dict[str, dict[str, float]]:
    """Per process of one soak: end-point growth and trend of RSS and PSS, and the RSS trend's
    standard error (from the samples; PSS is not kept per sample)."""
    soak = json.loads(path.read_text())
    window = soak["window_s"]
    end = soak["samples"][-1]["t"]
    rows = [s for s in soak["samples"] if s["t"] >= end - window]
    out: dict[str, dict[str, float]] = {}
    for name, rss in soak["rss_details"].items():
        pss = soak["pss_details"].get(name, {})
        row = {
            "rss_end": rss["growth"],
            "rss_trend": rss["slope_per_hour"] * window / 3600,
            "pss_end": pss.get("growth", 0.0),
            "pss_trend": pss.get("slope_per_hour", 0.0) * window / 3600,
        }
        series = [(s["t"], s[name]) for s in rows if name in s]
        if len(series) > 2:
            row["rss_trend_se"] = growth([t for t, _ in series], [v for _, v in series])["trend_se"]
        out[process_kind(name)] = row
    return out


def show_trends(soaks: list[Path], top: int = 3, as_json: bool = False) -> int:
    """Print each saved soak's largest growth and its `top` processes (`as_json`: every
    process, as JSON); exit status 0."""
    table: dict[str, Any] = {str(p): trends(p) for p in soaks}
    if as_json:
        print(json.dumps(table, indent=1))
        return 0
    for path, rows in table.items():
        largest = {
            k: max(max(r[f"rss_{k}"], r[f"pss_{k}"]) for r in rows.values())
            for k in ("end", "trend")
        }
        print(
            f"{Path(path).name}: largest end {largest['end']:+.2%}, "
            f"largest trend {largest['trend']:+.2%}"
        )
        worst = sorted(rows.items(), key=lambda r: -max(r[1][k] for k in FIGURES))
        for name, r in worst[:top]:
            se = f" (se {r['rss_trend_se']:.2%})" if "rss_trend_se" in r else ""
            print(
                f"  {name:28s} RSS end {r['rss_end']:+.2%} trend {r['rss_trend']:+.2%}{se}"
                f"  PSS end {r['pss_end']:+.2%} trend {r['pss_trend']:+.2%}"
            )
    return 0
