"""`dsbd distill`: train a small draft for a target by knowledge distillation.

    dsbd distill --target smollm2 --out drafts/mine

The training is dsbd.distill (teacher cache, then KL training, both resumable);
here the flags (their defaults are the tool's own config defaults), their checks (exit 2) and
the progress lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsbd.common import DEFAULT_TARGET, add_device_flag, fail, resolve_device

if TYPE_CHECKING:
    from dsbd.distill import CacheConfig, DraftSpec, TrainConfig
    from dsbd_core.models import LoadedModel


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd distill` and its flags."""
    from dsbd.distill import CacheConfig, CachePlan, DraftSpec, TrainConfig

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
    add_device_flag(distill)
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
    _add_training_flags(distill.add_argument_group("training"), train)


def _add_training_flags(group: argparse._ArgumentGroup, train: TrainConfig) -> None:
    """The `training` group: the TrainConfig knobs and how far this call goes."""
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


def _configs(args: argparse.Namespace) -> tuple[DraftSpec, CacheConfig, TrainConfig]:
    """The tool's configs from the flags (their own checks raise ValueError)."""
    from dsbd.distill import CacheConfig, DraftSpec, TrainConfig

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
    return spec, cache, config


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """`dsbd distill`: check the flags and load the target, then cache, train or export."""
    import torch
    from transformers.utils import logging as hf_logging

    from dsbd.distill import default_work_dir
    from dsbd.prompts import load_prompts
    from dsbd_core.models import ModelSourceError, load_causal_lm

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    try:
        device = resolve_device(args.device)
        spec, cache, config = _configs(args)
        prompts = load_prompts(args.prompts) if args.prompts else None
        target = load_causal_lm(args.target)
    except (ModelSourceError, OSError, ValueError) as error:
        return fail(str(error))
    target.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
    work = Path(args.work_dir).expanduser() if args.work_dir else default_work_dir(target)
    _say(f"device {device}; work dir {work}")
    try:
        return _cache_and_train(args, target, work, spec, cache, config, prompts)
    except (ValueError, FileNotFoundError) as error:
        return fail(str(error))


def _cache_and_train(
    args: argparse.Namespace,
    target: LoadedModel,
    work: Path,
    spec: DraftSpec,
    cache: CacheConfig,
    config: TrainConfig,
    prompts: Any,
) -> int:
    """The phases the flags ask for; raises ValueError / FileNotFoundError on bad state."""
    from dsbd.distill import CachePlan, build_cache, train

    if args.export_checkpoint:
        from dsbd.distill import export_checkpoint

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
            progress=_say,
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
        log=_say,
    )
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
