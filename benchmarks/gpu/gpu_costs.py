"""Per-iteration cost of DSBD's model calls at paper-like sizes, and the speedup it implies.

Issue 7 item 5. On the project's CPU a forest verify of W x gamma nodes costs nearly what the
target steps it replaces cost (a CPU forward is compute-bound), so no CPU run can say what DSBD
gives where it is meant to run. This script measures the three model calls of an iteration on
whatever device it is given, at the sizes of the paper's pairs (a 68M draft shaped like
JackFram/llama-68m, a 7B target shaped like Llama-2-7B, bf16; `--size qwen`: the shapes of the
Qwen2.5-Coder 0.5B/1.5B pair), with random weights: a forward's time depends on shapes, not on
weight values.

What is timed is the engine's own path, not an approximation: the decode loop
(dsbd_core/algorithm/drivers/loop.py) decodes a random prompt of the given context length with
`TransformerScorer`s over the two models, and a thin wrapper times every `ScoreCall` it makes
(`set_roots` + `forward`, the KV compaction included), with a device synchronisation on both sides:

(a) draft step: DSBD's gamma draft calls of an iteration, one per draft layer: the first
    feeds the W roots' new tokens (`set_roots` + `forward([])`), the others one layer of W
    draft nodes (`forward([layer])`);
(b) forest verification: the target's one call per DSBD iteration, which feeds the roots' last
    token and all W x gamma forest nodes under the tree mask;
(c) beam-sampling step: the target's one call per iteration of beam sampling at width W.

Iterations start after `--warmup` untimed ones (the first is the prefill), so every timed call
works on a KV cache of the given context length (growing by at most gamma + 1 tokens per
iteration). Figures are medians over `--repeats` iterations. The engine's host-side work per
iteration (sampling, verification, bookkeeping, on the CPU) is the iteration's wall time minus
its model calls, reported separately. With random weights the draft's forest shape and which
verification branches run are those of a random pair; model-call shapes are not (fixed width,
no EOS: always W roots, W nodes per draft layer).

Modelled speedup over beam sampling at the same W, for accepted lengths measured on the real
Qwen2.5-Coder pair (read from benchmarks/results/):

    speedup = E * t_beam / (T_draft + t_verify)

E = tokens per iteration = mean accepted layers + 1 (the fallback or bonus token), T_draft =
the gamma draft calls of an iteration (about gamma * t_draft_step), t_verify = the verify call,
t_beam = one beam-sampling step. The root's beam-sampling step needs no extra term: the verify
call feeds each root's last token, the work of a beam step, in the same forward. A second
figure adds the engine's host work on both sides. Every such figure is labelled "modelled":
it combines costs measured here with acceptance measured elsewhere, and is not a decode timed
on this device; directly measured GPU figures (a `dsbd bench --device cuda` run in
benchmarks/results/) are listed next to them when they exist.

    .venv/bin/python benchmarks/gpu/gpu_costs.py                       # GPU: paper sizes, bf16
    .venv/bin/python benchmarks/gpu/gpu_costs.py --size tiny --device cpu --dtype float32 \
        --out /tmp/gpu_costs_smoke.json                            # CPU smoke run, ~1 min

This file is the command line; the work is in its siblings: gpu_costs_models.py (the
random-weight pair), gpu_costs_timing.py (the timed scorer and its records), gpu_costs_engine.py
(the timed engine runs: every use of `Engine`), gpu_costs_acceptance.py (E from the result files,
the modelled speedups) and gpu_costs_report.py (the markdown table, the output path).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from dsbd.bench.decode.harness import git_info, machine_info, versions
from dsbd_core.models.dtypes import DTYPES
from dsbd_core.models.static_step import COMPILE_MODES

# The sibling modules are top-level modules when this file runs as a script (benchmarks/ is then
# on sys.path) and modules of the `benchmarks` namespace package when it is imported from the
# repository root (tests/tools/test_gpu_costs.py loads it by path).
try:
    from gpu_costs_acceptance import (
        RESULTS,
        acceptance_sources,
        measured_gpu_figures,
        modelled_speedups,
    )
    from gpu_costs_engine import measure_costs
    from gpu_costs_models import DEFAULT_CONTEXTS, SIZES, build_model, describe_model
    from gpu_costs_report import FORMULA, FORMULA_HOST, MODELLED_NOTE, default_out, markdown
    from gpu_costs_timing import Bench
except ModuleNotFoundError:
    from benchmarks.gpu.gpu_costs_acceptance import (
        RESULTS,
        acceptance_sources,
        measured_gpu_figures,
        modelled_speedups,
    )
    from benchmarks.gpu.gpu_costs_engine import measure_costs
    from benchmarks.gpu.gpu_costs_models import DEFAULT_CONTEXTS, SIZES, build_model, describe_model
    from benchmarks.gpu.gpu_costs_report import (
        FORMULA,
        FORMULA_HOST,
        MODELLED_NOTE,
        default_out,
        markdown,
    )
    from benchmarks.gpu.gpu_costs_timing import Bench


# What the modelled figures are of, per size: E always comes from the real Qwen pair.
SIZE_NOTES = {
    "paper": "E comes from the Qwen2.5-Coder 0.5B/1.5B pair (CPU); with paper-size costs it "
    "models a pair as cost-lopsided as 68M/7B accepting like that pair, not the acceptance of "
    "JackFram/llama-68m for Llama-2-7B (not measured here)",
    "qwen": "E comes from the Qwen2.5-Coder 0.5B/1.5B pair (CPU) and the costs from random "
    "weights of the same shapes: the modelled figure is that pair's on this device",
    "tiny": "tiny shapes: a smoke run, the modelled figures mean nothing",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="paper" if cuda else "tiny",
        help="model shapes (default: paper on CUDA, tiny on CPU)",
    )
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bfloat16" if cuda else "float32"
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--gammas",
        type=int,
        nargs="*",
        default=[1, 2, 3, 4],
        help="DSBD depths timed (none: beam steps only)",
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=None,
        help="prompt (KV cache) lengths; default 256 1024 (paper), 32 128 (tiny)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (>= 1: prefill)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed iterations per config (default 20 on CUDA, 5 on CPU)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="dynamic-width threshold of the timed DSBD runs (default: fixed "
        "width; the model calls' shapes do not depend on it, host work does)",
    )
    parser.add_argument(
        "--decode-path",
        choices=("dynamic", "static"),
        default="dynamic",
        help="the scorers' decode path (static: fixed buckets over a KV pool, CUDA graphs on "
        "CUDA); default dynamic",
    )
    parser.add_argument(
        "--engine",
        choices=("model", "cpu", "graph"),
        default="model",
        help="where the engine's state and draws live: beside the models (as `generate` puts "
        "them; default), on the host (as a serving router's engine), or beside the models "
        "with the verify side after its forward as one compiled graph (side_graphs.py)",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=None,
        help="how the static path runs its buckets (default: cuda-graph on CUDA, none on CPU)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="where the measured acceptance results are read from",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (markdown next to it); "
        "default benchmarks/results/gpu/<device>/costs/gpu_costs_<size>.json",
    )
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure, model, write JSON + markdown; returns the report (tests call this)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    contexts = args.contexts or list(DEFAULT_CONTEXTS[args.size])
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    torch.manual_seed(args.seed)
    shapes = SIZES[args.size]
    draft = build_model(shapes["draft"], device, dtype)
    target = build_model(shapes["target"], device, dtype)
    bench = Bench(
        target,
        draft,
        device,
        max(args.warmup, 1),
        repeats,
        args.threshold,
        args.seed,
        args.decode_path,
        args.engine,
        args.compile,
    )
    beams, dsbd = measure_costs(bench, contexts, args.widths, args.gammas, not args.no_progress)
    sources, notes = acceptance_sources(args.results, args.gammas)
    modelled = modelled_speedups(sources, beams, dsbd)
    timed = {(c.width, c.gamma) for c in dsbd}
    notes += [
        f"{s.method} ({s.label}): W = {s.width}, γ = {s.gamma} not timed, not modelled"
        for s in sources
        if (s.width, s.gamma) not in timed
    ]
    report = {
        "what": __doc__.splitlines()[0],
        "formula": FORMULA,
        "formula_with_host": FORMULA_HOST,
        "modelled_note": MODELLED_NOTE,
        "settings": {
            "size": args.size,
            "device": str(device),
            "dtype": args.dtype,
            "widths": args.widths,
            "gammas": args.gammas,
            "contexts": contexts,
            "warmup": bench.warmup,
            "repeats": repeats,
            "threshold": args.threshold,
            "threads": args.threads,
            "seed": args.seed,
            "decode_path": args.decode_path,
            "engine": args.engine,
            "compile": args.compile,
            "draft_width": "W (W_S = W)",
        },
        "machine": machine_info(device),
        "versions": versions(),
        "git": git_info(),
        "models": {
            "draft": describe_model(draft, shapes["draft"]),
            "target": describe_model(target, shapes["target"]),
        },
        "costs": {"beam": [asdict(b) for b in beams], "dsbd": [asdict(c) for c in dsbd]},
        "acceptance_sources": [asdict(s) for s in sources],
        "modelled": modelled,
        "measured_gpu": measured_gpu_figures(args.results),
        "static_path": {
            which: scorer.status()
            for which, scorer in bench.scorers.items()
            if hasattr(scorer, "status")
        },
        "notes": notes
        + [
            "weights are random: call costs depend on shapes; the forest's parent structure and "
            "the verification branches taken are those of a random pair",
            "host work = iteration wall time minus its model calls (engine sampling, "
            "verification and bookkeeping on the CPU)",
            SIZE_NOTES[args.size],
        ],
    }
    out = args.out or default_out(device, args.size)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
