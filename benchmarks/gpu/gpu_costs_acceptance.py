"""Tokens per iteration E measured on the real pair, and the speedups modelled from them, for
benchmarks/gpu/gpu_costs.py.

E is read from result files in benchmarks/results/ (measured elsewhere, on CPU); the modelled
speedup combines it with the per-call costs timed by gpu_costs_engine.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsbd.bench.decode.methods import MethodNameError, parse_method
from dsbd.theory.predictor import tokens_per_iteration

try:  # `python benchmarks/gpu/gpu_costs.py`: benchmarks/gpu/ is on sys.path
    from gpu_costs_timing import BeamCost, DsbdCost
except ModuleNotFoundError:  # imported from the repository root (tests load it by path)
    from benchmarks.gpu.gpu_costs_timing import BeamCost, DsbdCost

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


# ----------------------------------------------------------------------------------- acceptance
@dataclass
class AcceptanceSource:
    """Tokens per iteration E of one method, measured (or modelled from alpha) on a real pair."""

    label: str
    method: str
    width: int
    gamma: int
    tokens_per_iteration: float
    source: str
    how: str


def shown(path: Path) -> str:
    """A path as the report names it: relative to the repository when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _method_shape(name: str) -> tuple[int, int, bool] | None:
    """(W, gamma, lean) of an engine method name; None for other methods."""
    try:
        spec = parse_method(name, gamma=1)
    except MethodNameError:
        return None
    if spec.family not in ("sps", "dsbd") or spec.gamma is None:
        return None
    return spec.width, spec.gamma, spec.lean


def sps_alpha_sources(path: Path, gammas: Sequence[int]) -> list[AcceptanceSource]:
    """Plain SpS at every gamma from the pair's measured acceptance alpha (i.i.d. model)."""
    alpha = json.loads(path.read_text())["overall"]["acceptance"]
    return [
        AcceptanceSource(
            label=f"SpS, alpha = {alpha:.3f} (i.i.d. model)",
            method=f"sps-g{gamma}",
            width=1,
            gamma=gamma,
            tokens_per_iteration=tokens_per_iteration(alpha, gamma),
            source=shown(path),
            how="E = sum_{k=0..gamma} alpha^k, alpha = overall Σ min(p, q) of eval-acceptance",
        )
        for gamma in gammas
    ]


def bench_sources(path: Path) -> list[AcceptanceSource]:
    """Mean accepted length per method of a `dsbd bench` run (results.json: summary)."""
    summary = json.loads(path.read_text())["summary"]
    out = []
    for name, row in summary.items():
        shape = _method_shape(name)
        length = row.get("mean_accepted_length")
        if shape is None or length is None or row.get("source", "dsbd") != "dsbd":
            continue
        out.append(
            AcceptanceSource(
                label=f"dsbd bench ({path.parent.name})",
                method=name,
                width=shape[0],
                gamma=shape[1],
                tokens_per_iteration=length + 1.0,
                source=shown(path),
                how="E = mean accepted layers per iteration + 1",
            )
        )
    return out


def width_distinct_sources(path: Path) -> list[AcceptanceSource]:
    """Accepted layers per iteration with the current width rule (the "estimate" rows)."""
    methods = json.loads(path.read_text())["methods"]
    out = []
    for name, row in methods.items():
        shape = _method_shape(name)
        if shape is None or "estimate" not in row:
            continue
        length = row["estimate"]["accepted_layers_per_iteration"]
        out.append(
            AcceptanceSource(
                label=f"width estimate ({path.stem})",
                method=name,
                width=shape[0],
                gamma=shape[1],
                tokens_per_iteration=length + 1.0,
                source=shown(path),
                how="E = accepted layers per iteration + 1 (distinct-draft width estimate)",
            )
        )
    return out


def acceptance_sources(
    results: Path, gammas: Sequence[int]
) -> tuple[list[AcceptanceSource], list[str]]:
    """Every E measured on the real pair that the result files hold, and what was left out."""
    notes: list[str] = []
    sources: list[AcceptanceSource] = []
    readers = [
        (results / "qwen_pair_acceptance.json", lambda p: sps_alpha_sources(p, gammas)),
        (results / "bench_qwen-coder_full" / "results.json", bench_sources),
        # the width rule's A/B (the distinct-draft estimate against the i.i.d. DP)
        (results / "width_distinct_qwen-coder.json", width_distinct_sources),
    ]
    for path, read in readers:
        if not path.exists():
            notes.append(f"{shown(path)}: missing, its acceptance is not modelled")
            continue
        sources.extend(read(path))
    kept = [s for s in sources if not _method_shape(s.method)[2]]
    if len(kept) < len(sources):
        notes.append(
            "lean-memory methods left out: they keep one root row between iterations, a shape "
            "this grid does not time"
        )
    return kept, notes


# ----------------------------------------------------------------------------------- modelled
def modelled_speedups(
    sources: Sequence[AcceptanceSource], beams: Sequence[BeamCost], dsbd: Sequence[DsbdCost]
) -> list[dict]:
    """FORMULA (and FORMULA_HOST) for every source at every timed context with its (W, gamma)."""
    beam_at = {(b.context, b.width): b for b in beams}
    out = []
    for cost in dsbd:
        beam = beam_at[(cost.context, cost.width)]
        for source in sources:
            if (source.width, source.gamma) != (cost.width, cost.gamma):
                continue
            e = source.tokens_per_iteration
            iteration = cost.draft_iteration_ms + cost.verify_ms
            out.append(
                {
                    "kind": "modelled",
                    "label": source.label,
                    "method": source.method,
                    "width": cost.width,
                    "gamma": cost.gamma,
                    "context": cost.context,
                    "tokens_per_iteration": e,
                    "t_beam_ms": beam.beam_step_ms,
                    "t_draft_ms": cost.draft_iteration_ms,
                    "t_verify_ms": cost.verify_ms,
                    "speedup": e * beam.beam_step_ms / iteration,
                    "speedup_with_host": e
                    * (beam.beam_step_ms + beam.host_ms)
                    / (iteration + cost.host_ms),
                    "source": source.source,
                }
            )
    return out


def measured_gpu_figures(results: Path) -> list[dict]:
    """Time ratios of `dsbd bench` runs made on a GPU, to print next to the modelled ones."""
    out = []
    for path in sorted(results.rglob("results.json")):  # results/gpu/<device>/bench/ too
        data = json.loads(path.read_text())
        config = data.get("config", {})
        if not str(config.get("device", "")).startswith("cuda"):
            continue
        for name, row in data.get("summary", {}).items():
            ratio = (row.get("time_vs_reference") or {}).get("value")
            if ratio:
                out.append(
                    {
                        "kind": "measured",
                        "run": shown(path),
                        "method": name,
                        "width": row.get("width"),
                        "speedup": 1.0 / ratio,
                        "device": config.get("device"),
                        "dtype": config.get("dtype"),
                    }
                )
    return out
