"""`dsbd eval-acceptance`: how often a draft's tokens are accepted by its target.

    dsbd eval-acceptance --target smollm2 --draft smollm2-draft

The measurement is dsbd.acceptance; here the flags, their checks (exit 2 before any
model loads), loading the pair on the chosen device and the printed table or JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET, add_device_flag, fail, resolve_device

if TYPE_CHECKING:
    from dsbd_core.models import LoadedModel


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd eval-acceptance` and its flags."""
    evaluate = commands.add_parser(
        "eval-acceptance",
        help="how often a draft's tokens are accepted: mean sum_x min(p, q), greedy agreement",
        description=(
            "Sample continuations from the target on held-out prompts (English and code, "
            "dsbd.prompts.EVAL_PROMPTS unless --prompts), teacher-force them through "
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
    add_device_flag(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")


def _load_pair(target_source: str, draft_source: str) -> tuple[LoadedModel, LoadedModel]:
    from transformers.utils import logging as hf_logging

    from dsbd_core.models import check_same_vocabulary, load_causal_lm

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    target = load_causal_lm(target_source)
    draft = load_causal_lm(draft_source)
    check_same_vocabulary(target, draft)
    return target, draft


def run(args: argparse.Namespace) -> int:
    """`dsbd eval-acceptance`: check the flags, load the pair, sample, score, print."""
    import torch

    from dsbd.acceptance import measure_acceptance, sample_prompt_continuations
    from dsbd.prompts import EVAL_PROMPTS, load_prompts
    from dsbd_core.models import ModelSourceError, VocabularyMismatchError

    if args.temperature <= 0 or args.new_tokens < 1 or args.batch_size < 1:
        return fail("need --temperature > 0, --new-tokens >= 1, --batch-size >= 1")
    try:
        prompts = load_prompts(args.prompts) if args.prompts else list(EVAL_PROMPTS)
    except (OSError, ValueError) as error:
        return fail(f"cannot read prompts: {error}")
    if args.kinds:
        wanted = {k.strip() for k in args.kinds.split(",")}
        prompts = [p for p in prompts if p.kind in wanted]
        if not prompts:
            return fail(f"no prompt of kind {sorted(wanted)}")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        return fail(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        target, draft = _load_pair(args.target, args.draft)
    except (ModelSourceError, VocabularyMismatchError) as error:
        return fail(str(error))
    target.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
    draft.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
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
    else:
        _print_table(args, report)
    return 0


def _print_table(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The human-readable view of the report: one row per prompt kind, then overall."""
    print(
        f"target {report['target']}, draft {report['draft']}, temperature {args.temperature}, "
        f"{report['prompts']} prompts x {args.new_tokens} sampled tokens, seed {args.seed}, "
        f"device {report['device']}"
    )
    print(f"{'kind':<18} {'positions':>9} {'acceptance':>10} {'greedy':>7}")
    rows = [*report["kinds"].items(), ("overall", report["overall"])]
    for kind, stats in rows:
        print(
            f"{kind:<18} {stats['positions']:>9} {stats['acceptance']:>10.3f} "
            f"{stats['greedy_agreement']:>7.3f}"
        )
    print(
        f"(load {report['load_s']:.1f} s, sampling {report['sample_s']:.1f} s, "
        f"scoring {report['score_s']:.1f} s)"
    )
