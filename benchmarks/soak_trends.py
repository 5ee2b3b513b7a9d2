"""Soaks side by side: each process's growth over the last window by its end points and by
the least-squares trend over all of the window's samples (benchmarks/soak.py's `growth`).

Why: the end-point figure (mean of the window's last three samples over its first three)
moves by +-2 % for a process whose live memory follows the work in flight (the verifier),
with no trend; the fit over 120 samples moves far less. This reads the `*_details` of saved
soak.json files (the slope per hour was in every one) and, from the RSS samples they keep,
the trend's standard error, so figures of earlier soaks can be put beside new ones.

    .venv/bin/python benchmarks/soak_trends.py benchmarks/results/soak*.json
    .venv/bin/python benchmarks/soak_trends.py --top 4 --json FILE...
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from soak import growth  # benchmarks/ is on sys.path when this runs as a script

FIGURES = ("rss_end", "rss_trend", "pss_end", "pss_trend")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("soaks", nargs="+", type=Path, help="soak.json files")
    parser.add_argument("--top", type=int, default=3, help="processes shown per soak")
    parser.add_argument("--json", action="store_true", help="every process, as JSON")
    args = parser.parse_args(argv)
    table: dict[str, Any] = {str(p): trends(p) for p in args.soaks}
    if args.json:
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
        for name, r in worst[: args.top]:
            se = f" (se {r['rss_trend_se']:.2%})" if "rss_trend_se" in r else ""
            print(
                f"  {name:28s} RSS end {r['rss_end']:+.2%} trend {r['rss_trend']:+.2%}{se}"
                f"  PSS end {r['pss_end']:+.2%} trend {r['pss_trend']:+.2%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
