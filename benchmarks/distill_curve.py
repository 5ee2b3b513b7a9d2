"""Learning curve of a `dsbd distill` run: held-out acceptance and training loss vs. time.

Reads the run's `log.jsonl` (written by `dsbd.distill.train`) and writes the numbers
(`--json`) and a plot (`--png`): held-out acceptance `Σ min(p, q)` at T = 1 per prompt kind and
overall vs. training step (top axis: CPU hours of training), and the KL training loss.

    .venv/bin/python benchmarks/distill_curve.py --run ~/.cache/dsbd/distill/smollm2/run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_log(run: Path) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) of a run; a resumed run may repeat a step: the
    last record of each step wins (it is the one the checkpoint continued from)."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in (run / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "heldout" in record:
            evals[record["step"]] = record
        elif "kl" in record:
            steps[record["step"]] = record
    return [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)]


def summarise(run: Path) -> dict:
    steps, evals = read_log(run)
    curve = [
        {
            "step": e["step"],
            "train_hours": e["elapsed_s"] / 3600,
            "acceptance": e["heldout"]["overall"]["acceptance"],
            "greedy_agreement": e["heldout"]["overall"]["greedy_agreement"],
            "kinds": {k: v["acceptance"] for k, v in e["heldout"]["kinds"].items()},
        }
        for e in evals
    ]
    best = max(curve, key=lambda c: c["acceptance"]) if curve else None
    return {
        "run": str(run),
        "heldout_curve": curve,
        "best": best,
        "loss": [{"step": s["step"], "kl": s["kl"], "lr": s["lr"]} for s in steps],
        "train_hours": steps[-1]["elapsed_s"] / 3600 if steps else 0.0,
    }


def plot(summary: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = summary["heldout_curve"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = [c["step"] for c in curve]
    top.plot(steps, [c["acceptance"] for c in curve], "k-o", lw=2, ms=3, label="overall")
    for kind in curve[0]["kinds"] if curve else []:
        top.plot(steps, [c["kinds"].get(kind) for c in curve], "-", lw=1, label=kind)
    top.axhline(0.40, color="r", ls="--", lw=1, label="goal 0.40")
    top.set_ylabel("held-out acceptance Σ min(p, q), T = 1")
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="lower right")
    if curve:
        hours = top.secondary_xaxis(
            "top",
            functions=(
                lambda s: _interp(s, steps, [c["train_hours"] for c in curve]),
                lambda h: _interp(h, [c["train_hours"] for c in curve], steps),
            ),
        )
        hours.set_xlabel("training wall time (hours; 1 thread on a shared 2-core CPU)")
    loss = summary["loss"]
    bottom.plot([r["step"] for r in loss], [r["kl"] for r in loss], lw=0.8)
    bottom.set_yscale("log")
    bottom.set_ylabel("training KL(p || q) (top-64 + rest)")
    bottom.set_xlabel("optimizer step (16 sequences each)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def _interp(x, xs, ys):
    import numpy as np

    return np.interp(x, xs, ys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="the run directory (log.jsonl)")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "smollm2_draft_curve.json"
    )
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "smollm2_draft_curve.png")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct draft: cut 4 layers, distilled")
    args = parser.parse_args()
    summary = summarise(args.run.expanduser())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, args.png, args.title)
    best = summary["best"]
    if best:
        print(
            f"best held-out acceptance {best['acceptance']:.3f} at step {best['step']} "
            f"({best['train_hours']:.2f} h); wrote {args.json} and {args.png}"
        )


if __name__ == "__main__":
    main()
