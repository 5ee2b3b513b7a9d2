"""Our DSBD against the reference implementation (ZongyueQin/DSBD), same pair, prompts, settings.

The reference runs in its own venv (transformers 4.35.2) inside a long-lived worker process
(`ref_worker.py`); ours runs in this process (our venv) through the `dsbd bench` harness's own
pieces (`dsbd.bench.decode`: prompt sets, method names, runners, measurement, quality), so our
figures here are measured exactly as `dsbd bench` measures them. For every prompt and method the
two sides run back to back and alternate which goes first, so slow phases of the shared, noisy
CPU hit both alike; both use one torch thread, the same seed and the same stop token.

Per decode, both sides: wall and CPU time of the decode call, decoding steps, target and draft
forward calls (forward hooks on both sides), peak KV-cache bytes, and quality: the target
log-likelihood of the returned answer recomputed here by our target model, and HumanEval
pass@1 (sandboxed) on the `humaneval` prompt set.

    .venv/bin/python benchmarks/investigations/reference/side_by_side.py --pair smollm2
    .venv/bin/python benchmarks/investigations/reference/side_by_side.py --pair qwen-coder \\
        --prompts 4

Outputs (default stem benchmarks/investigations/reference/results/<pair>_<set>_n<N>_m<tokens>):
  <stem>.json            settings, versions, parity check, per-method comparison, all records
  <stem>.records.jsonl   the reference's MethodRecords (`dsbd bench --extra-records` folds them in)
  <stem>.md              the comparison as a markdown table
Set-up of the reference venv and checkout: benchmarks/investigations/reference/README.md.

This file is the command line; the work is in its siblings: side_by_side_sides.py (both sides'
models, the reference worker, the parity check), side_by_side_decode.py (one decode on either
side and its quality), side_by_side_run.py (warm-up, the alternating schedule, scoring) and
side_by_side_report.py (the comparison, the result JSON and markdown).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dsbd.bench.decode.humaneval import default_sandbox
from dsbd.bench.decode.measure import EnergyMeter
from dsbd.bench.decode.methods import MethodSpec, parse_methods
from dsbd.prompts import PROMPT_SETS, prompt_set

# Sibling modules: top-level when this file runs as a script (its folder is then on sys.path),
# in the `benchmarks` namespace package when imported from the repository root.
try:
    from side_by_side_report import build_result, write_outputs
    from side_by_side_run import Run, prepare, run_schedule, schedule, score
    from side_by_side_sides import Sides
except ModuleNotFoundError:
    from benchmarks.investigations.reference.side_by_side_report import build_result, write_outputs
    from benchmarks.investigations.reference.side_by_side_run import (
        Run,
        prepare,
        run_schedule,
        schedule,
        score,
    )
    from benchmarks.investigations.reference.side_by_side_sides import Sides

PAIRS = {
    "smollm2": ("smollm2", "smollm2-draft", "held-out"),
    "qwen-coder": ("qwen-coder", "qwen-coder-draft", "humaneval"),
}
REFERENCE_FAMILIES = ("dsbd", "sps", "beam", "sample")  # what the reference code implements


def parse_args() -> tuple[argparse.Namespace, list[MethodSpec]]:
    """The settings (defaults of --prompt-set and --sandbox filled in) and the methods to run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, help="default: the pair's")
    parser.add_argument("--prompts", type=int, default=8, help="the first N of the set")
    parser.add_argument(
        "--methods",
        default="dsbd-w3-t0.7,dsbd-w3-fixed,beam-w3",
        help="names in the dsbd bench grammar; families: " + ", ".join(REFERENCE_FAMILIES),
    )
    parser.add_argument("--gamma", type=int, default=2, help="draft depth where a name has no g")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--humaneval-timeout", type=float, default=10.0)
    parser.add_argument("--sandbox", default=None, help="HumanEval sandbox (default: best)")
    parser.add_argument("--ref-python", default="/work/ref/venv/bin/python")
    parser.add_argument("--ref-dir", default="/work/ref/DSBD")
    parser.add_argument(
        "--out", help="output stem (default benchmarks/investigations/reference/results/...)"
    )
    parser.add_argument(
        "--low-memory",
        action="store_true",
        help="only one side's models in memory at a time (sides then alternate per prompt)",
    )
    args = parser.parse_args()
    specs = parse_methods(args.methods, gamma=args.gamma)
    unsupported = [s.name for s in specs if s.family not in REFERENCE_FAMILIES]
    if unsupported:
        parser.error(f"--methods: {unsupported} have no counterpart in the reference code")
    _, _, default_set = PAIRS[args.pair]
    args.prompt_set = args.prompt_set or default_set
    args.sandbox = args.sandbox or default_sandbox()
    return args, specs


def output_stem(args: argparse.Namespace) -> Path:
    """benchmarks/investigations/reference/results/<pair>_<set>_n<N>_m<tokens>[_k<k>_p<p>]
    unless --out."""
    filters = f"_k{args.top_k}_p{args.top_p:g}" if args.top_k or args.top_p < 1.0 else ""
    stem = f"{args.pair}_{args.prompt_set}_n{args.prompts}_m{args.max_new_tokens}{filters}"
    out = Path(args.out or f"benchmarks/investigations/reference/results/{stem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def main() -> None:
    args, specs = parse_args()
    target_name, draft_name, _ = PAIRS[args.pair]
    torch.set_num_threads(args.threads)
    out = output_stem(args)

    prompts = prompt_set(args.prompt_set)[: args.prompts]
    Path(f"{out}.worker.log").write_text("")
    energy = EnergyMeter(torch.device("cpu"))
    sides = Sides(args, (target_name, draft_name), f"{out}.worker.log")
    run = Run(args, specs, prompts, sides, energy)
    parity_ids, theirs = prepare(run)
    decodes, speculation, errors = run_schedule(run, schedule(len(prompts), specs, args.low_memory))
    sides.close_reference()

    check, records = score(run, decodes, theirs, parity_ids)
    write_outputs(out, build_result(run, check, records, errors, speculation), records)


if __name__ == "__main__":
    main()
