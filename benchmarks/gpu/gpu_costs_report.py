"""The markdown report of benchmarks/gpu/gpu_costs.py and where it is written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

try:  # `python benchmarks/gpu/gpu_costs.py`: benchmarks/gpu/ is on sys.path
    from gpu_costs_acceptance import RESULTS
except ModuleNotFoundError:  # imported from the repository root (tests load it by path)
    from benchmarks.gpu.gpu_costs_acceptance import RESULTS

FORMULA = "speedup = E * t_beam / (T_draft + t_verify)"
FORMULA_HOST = "speedup_with_host = E * (t_beam + h_beam) / (T_draft + t_verify + h_dsbd)"
MODELLED_NOTE = (
    "modelled: per-call costs measured here (random weights) combined with tokens per "
    "iteration E measured on the real Qwen2.5-Coder pair on CPU; not a decode timed here"
)


# ----------------------------------------------------------------------------------- outputs
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    """The costs table, the modelled speedups and any measured GPU figure, as markdown."""
    s = report["settings"]
    lines = [
        f"# Per-iteration costs: {s['size']} pair on {report['machine'].get('gpu', s['device'])}",
        "",
        f"dtype {s['dtype']}, torch {report['versions']['torch']}, random weights; draft "
        f"{report['models']['draft']['parameters'] / 1e6:.1f}M, target "
        f"{report['models']['target']['parameters'] / 1e6:.1f}M parameters; median of "
        f"{s['repeats']} iterations after {s['warmup']} warm-up; width rule "
        f"{'fixed' if s['threshold'] is None else 't = ' + str(s['threshold'])}.",
        "",
        "## Measured cost per call (ms)",
        "",
        "| context | W | γ | draft root call | draft layer call | draft calls / iteration "
        "| verify (W·γ nodes) | verify input rows x tokens | beam step | verify / beam step "
        "| host / DSBD iteration | host / beam step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    beam_at = {(b["context"], b["width"]): b for b in report["costs"]["beam"]}
    for c in report["costs"]["dsbd"]:
        b = beam_at[(c["context"], c["width"])]
        lines.append(
            f"| {c['context']} | {c['width']} | {c['gamma']} | {_fmt(c['draft_root_ms'])} | "
            f"{_fmt(c['draft_layer_ms'])} | {_fmt(c['draft_iteration_ms'])} | "
            f"{_fmt(c['verify_ms'])} | {c['verify_rows']} x {c['verify_tokens_per_row']} | "
            f"{_fmt(b['beam_step_ms'])} | "
            f"{_fmt(c['verify_over_beam_step'])} | {_fmt(c['host_ms'])} | {_fmt(b['host_ms'])} |"
        )
    lines += [
        "",
        "## Modelled speedup over beam sampling at the same W (modelled, not measured)",
        "",
        f"`{FORMULA}`; `{FORMULA_HOST}`. E: tokens per iteration measured on the real "
        "Qwen2.5-Coder pair (CPU runs); T_draft: the γ draft calls; the verify call already "
        "feeds each root's last token (the beam step of the root). W = 1: over multinomial "
        f"sampling. {MODELLED_NOTE}.",
        "",
        "| E from | method | W | γ | context | E | T_draft ms | t_verify ms | t_beam ms "
        "| modelled speedup | modelled, incl. host |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in report["modelled"]:
        lines.append(
            f"| {m['label']} | {m['method']} | {m['width']} | {m['gamma']} | {m['context']} | "
            f"{m['tokens_per_iteration']:.2f} | {m['t_draft_ms']:.2f} | {m['t_verify_ms']:.2f} | "
            f"{m['t_beam_ms']:.2f} | {m['speedup']:.2f} (modelled) | "
            f"{m['speedup_with_host']:.2f} (modelled) |"
        )
    lines += ["", "## Directly measured GPU figures", ""]
    if report["measured_gpu"]:
        lines += ["| run | method | W | measured speedup over beam |", "|---|---|---:|---:|"]
        lines += [
            f"| {m['run']} | {m['method']} | {m['width']} | {m['speedup']:.2f} (measured) |"
            for m in report["measured_gpu"]
        ]
    else:
        lines.append(
            "None: no `dsbd bench --device cuda` run is in benchmarks/results/ (no GPU has been "
            "lent to a session that could make one)."
        )
    lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def default_out(device: torch.device, size: str) -> Path:
    """benchmarks/results/gpu/<device>/costs/gpu_costs_<size>.json, the device named by its GPU
    when there is one."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return RESULTS / "gpu" / slug / "costs" / f"gpu_costs_{size}.json"
