"""`dsbd bench`: the benchmarks' entry points, and the flags and entry of the decode benchmark
(its harness is dsbd.bench.decode).

    dsbd bench                                  # = dsbd bench decode: smollm2 pair, quick mode
    dsbd bench --pair qwen-coder --full         # HumanEval subset, long run (resumable)
    dsbd bench --methods beam-w3,dsbd-w3-g2-t0.9 --prompts 2 --max-new-tokens 16
    dsbd bench --report-only --out DIR [--extra-records other.jsonl]
    dsbd bench serve|batch|load|chaos|soak ...  # the served path, batching, load, faults, memory

`dsbd bench [flags]` and `dsbd bench decode [flags]` are the same run: the decode flags stay on
`dsbd bench` itself, so commands written before the subcommands existed keep working. The other
subcommands' flags and code live in dsbd/bench/, one module each (`add_arguments`, `run`).

Decode flags are validated (pydantic, the method grammar) before any model loads; invalid values
exit with status 2 and name the flag, the value and what is allowed. The CLI builds the
BenchConfig and hands it to the harness, which never reads a command line (benchmarks/bench.py
reuses `add_arguments` and `main` as a script).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from dsbd.bench import batch, chaos, load, serve, soak
from dsbd.bench.decode.methods import (
    GRAMMAR,
    LOOKUP_FAMILIES,
    MethodNameError,
    parse_methods,
    with_references,
)
from dsbd.bench.decode.pairs import PAIRS
from dsbd.common import add_pair_flags
from dsbd.prompts import PROMPT_SETS
from dsbd_core.algorithm.config import config_error_message

if TYPE_CHECKING:
    from dsbd.bench.decode.schema import BenchConfig

DEFAULT_OUT = "benchmarks/results/bench_{pair}_{mode}"
DECODE_DESCRIPTION = (
    "Decode a fixed prompt set with sampling, SpS, beam sampling, DSBD and transformers' own "
    "generate, methods interleaved per prompt in one process; writes results.json, table.md and "
    "plots (benchmarks/README.md explains every figure)."
)
# `dsbd bench <name>` -> its module (add_arguments, run) and help, in the order --help lists them
BENCHMARKS = {
    "serve": (serve, "the served path: against in-process, DSBD against beam, its overhead"),
    "batch": (batch, "batched decodes against one at a time: the `dsbd batch` job, the engine"),
    "load": (load, "N clients against a running server: latency, errors, memory, sessions"),
    "chaos": (chaos, "replicas SIGKILLed under load: failures, recoveries, seeded tokens"),
    "soak": (soak, "steady load for 30 min: each server process's memory growth"),
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd bench`: the decode flags on it (no subcommand: decode) and the
    subcommands, each with its own flags."""
    bench = commands.add_parser(
        "bench",
        help="benchmarks: every decoder side by side (decode, the default), the served path, "
        "batching, load, chaos, soak",
        description=DECODE_DESCRIPTION + " Without a subcommand: decode. The subcommands "
        "measure the rest (`dsbd bench <subcommand> --help`); each writes one current result "
        "under benchmarks/results/.",
    )
    add_arguments(bench)
    benchmarks = bench.add_subparsers(dest="benchmark", title="subcommands", metavar="SUBCOMMAND")
    decode = benchmarks.add_parser(
        "decode",
        help="every decoder side by side in one process (the default)",
        description=DECODE_DESCRIPTION,
    )
    add_arguments(decode)
    for name, (module, summary) in BENCHMARKS.items():
        first_paragraph = " ".join((module.__doc__ or summary).split("\n\n")[0].split())
        module.add_arguments(benchmarks.add_parser(name, help=summary, description=first_paragraph))


def run(args: argparse.Namespace) -> int:
    """Run `dsbd bench [SUBCOMMAND]` (no subcommand: decode); returns the exit status."""
    name = getattr(args, "benchmark", None)
    if name in (None, "decode"):
        return main(args)
    return BENCHMARKS[name][0].run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dsbd bench` (defaults that depend on --pair/--quick/--full are None)."""
    parser.add_argument(
        "--pair",
        choices=[*PAIRS, "custom"],
        default="smollm2",
        help="model pair preset (default: smollm2); custom: --target/--draft",
    )
    parser.add_argument("--target", help="target model source (overrides the pair's)")
    parser.add_argument("--draft", help="draft model source (overrides the pair's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="minutes on this CPU (default)",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="the long run: more prompts, tokens and methods",
    )
    parser.set_defaults(mode="quick")
    parser.add_argument("--methods", help=f"comma-separated; grammar: {GRAMMAR}")
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, help="default: the pair's")
    parser.add_argument("--prompts", type=int, help="use the first N prompts of the set")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--gamma", type=int, help="draft depth where a method name has no g<G>")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    add_pair_flags(parser, knobs=False)  # every method (transformers' too) runs these models
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=4,
        help="unrecorded warm-up decode per method (0 = none)",
    )
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=1,
        help="decode every prompt this many times per method, interleaved; seconds are the "
        "median (default: 1)",
    )
    parser.add_argument("--humaneval-timeout", type=float, default=10.0, help="seconds")
    parser.add_argument(
        "--sandbox",
        choices=("namespace+audit", "namespace", "audit"),
        help="HumanEval sandbox (default: namespace+audit where it works)",
    )
    parser.add_argument("--out", help="output directory (default: " + DEFAULT_OUT + ")")
    parser.add_argument("--fresh", action="store_true", help="discard records in --out")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild results.json, table.md and plots from --out's records",
    )
    parser.add_argument(
        "--extra-records",
        nargs="*",
        default=[],
        help="MethodRecord JSONL files of another harness to fold in",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_config(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from the flags (raises ValueError / ValidationError naming the flag)."""
    # imported here, not at the top: it imports torch, which `dsbd --help` does without
    from dsbd.bench.decode.schema import BenchConfig
    from dsbd.prompts import EVAL_PROMPTS, HUMANEVAL_SUBSET
    from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT

    preset = PAIRS.get(args.pair)
    if preset is None and not (args.target and args.methods):
        raise ValueError(
            "--pair custom needs --target (and --draft for draft methods) and --methods"
        )
    defaults = preset.mode(args.mode) if preset else None
    gamma = args.gamma if args.gamma is not None else (preset.gamma if preset else 2)
    if gamma < 1:
        raise ValueError(f"--gamma={gamma}: allowed: an integer >= 1")
    methods_text = args.methods or ",".join(defaults.methods)  # type: ignore[union-attr]  # no preset: --methods is given (checked above)
    specs = with_references(parse_methods(methods_text, gamma=gamma))
    prompt_set = args.prompt_set or (preset.prompt_set if preset else "held-out")
    available = len(HUMANEVAL_SUBSET) if prompt_set == "humaneval" else len(EVAL_PROMPTS)
    prompts = args.prompts if args.prompts is not None else (defaults.prompts if defaults else 2)
    if not 1 <= prompts <= available:
        raise ValueError(f"--prompts={prompts}: allowed: 1..{available} for set {prompt_set}")
    draft = args.draft or (preset.draft if preset else None)
    if draft == LOOKUP_DRAFT:  # every drafting method drafts with the prompt lookup
        specs = [replace(s, lookup=True) if s.family in LOOKUP_FAMILIES else s for s in specs]
        draft = None
    if draft is None and any(s.uses_draft_model for s in specs):
        needing = [s.name for s in specs if s.uses_draft_model]
        raise ValueError(
            f"methods {needing} need a draft model: pass --draft (or -ng: the prompt lookup)"
        )
    return BenchConfig(
        pair=args.pair,
        target=args.target or preset.target,  # type: ignore[union-attr]  # no preset: --target is given (checked above)
        draft=draft,
        mode=args.mode,
        prompt_set=prompt_set,
        prompts=prompts,
        methods=[s.name for s in specs],
        max_new_tokens=args.max_new_tokens or (defaults.max_new_tokens if defaults else 16),
        gamma=gamma,
        seed=args.seed,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        device=args.device,
        dtype=args.dtype,
        decode_path=args.decode_path,
        draft_quantize=args.draft_quantize,
        draft_head_tokens=args.draft_head_tokens,
        ngram_max=args.ngram_max,
        threads=args.threads,
        warmup_tokens=args.warmup_tokens,
        timing_rounds=args.timing_rounds,
        humaneval_timeout_s=args.humaneval_timeout,
        sandbox=args.sandbox,
    )


def main(args: argparse.Namespace) -> int:
    """Run `dsbd bench decode`; exit status 2 for invalid flags."""
    from dsbd.bench.decode import harness

    out = Path(args.out or DEFAULT_OUT.format(pair=args.pair, mode=args.mode))
    try:
        extra = [r for path in args.extra_records for r in harness.read_records(Path(path))]
    except (OSError, ValidationError, ValueError) as error:
        print(f"--extra-records: {error}", file=sys.stderr)
        return 2
    if args.report_only:
        if not (out / "run.json").is_file():
            print(f"--report-only: {out}/run.json not found (no run there)", file=sys.stderr)
            return 2
        result = harness.rebuild_report(out, extra)
        print(f"{len(result.records)} records -> {out}/table.md")
        return 0
    try:
        config = build_config(args)
    except MethodNameError as error:
        print(f"--methods: {error}", file=sys.stderr)
        return 2
    except ValidationError as error:
        print(config_error_message(error), file=sys.stderr)
        return 2
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    try:
        harness.run_bench(
            config,
            out,
            fresh=args.fresh,
            progress=not args.no_progress,
            extra_records=extra,
            recalibrate=args.recalibrate,
        )
    except harness.ResumeMismatchError as error:
        print(str(error), file=sys.stderr)
        return 2
    print((out / "table.md").read_text())
    print(
        f"results: {out}/results.json, table.md, speed_quality.png, accepted_length.png, "
        "width_histogram.png"
    )
    return 0
