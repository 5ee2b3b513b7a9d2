"""`dsbd generate`: decode one prompt in-process and print the beams and the statistics.

    dsbd generate --method dsbd --prompt "Why is the sky blue?"

The flags are validated (SamplingConfig) before anything heavy is imported: transformers and
the models load only once the command line is known to be valid, so bad input exits 2 at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from dsbd.common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    add_device_flag,
    add_pair_flags,
    fail,
    resolve_device,
)
from dsbd.sampling_flags import add_config_flags, config_from_args
from dsbd_core.algorithm.config import SamplingConfig, config_error_message
from dsbd_core.algorithm.methods import METHODS, drafts
from dsbd_core.algorithm.sequences.stop_text import first_stop, stop_problem, text_floor

if TYPE_CHECKING:
    from dsbd_core.algorithm.sequences.result import DecodeResult
    from dsbd_core.models import LoadedModel
    from dsbd_core.models.options import DraftOptions


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd generate` and its flags (the SamplingConfig ones included)."""
    parser = commands.add_parser("generate", help="decode one prompt and print beams + stats")
    parser.add_argument("--method", choices=METHODS, default="dsbd", help="default: dsbd")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="preset, local dir, .gguf file or hub id"
    )
    parser.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="draft model (dsbd, sps, spec_beam_search); same vocabulary; or 'ngram': the "
        "prompt-lookup draft (no weights: drafts from the text itself)",
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the tokenizer's chat template (default: when it has one)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="a stop string (repeatable): a beam finishes where its text first holds one",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_device_flag(parser)
    add_pair_flags(parser)
    add_config_flags(parser)


def run(args: argparse.Namespace) -> int:
    """`dsbd generate`: the config is checked first (exit 2 naming the field), then decoded."""
    from dsbd_core.models.options import DraftOptions

    try:
        config = config_from_args(args)
        options = DraftOptions(
            quantize=args.draft_quantize,
            head_tokens=args.draft_head_tokens,
            ngram_max=args.ngram_max,
        )
    except ValidationError as error:
        print(config_error_message(error), file=sys.stderr)
        return 2
    problem = stop_problem(args.stop)
    if problem is not None:
        print(f"--stop: {problem}", file=sys.stderr)
        return 2
    return _generate(args, config, options)


def _generate(args: argparse.Namespace, config: SamplingConfig, options: DraftOptions) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from dsbd_core.algorithm.drivers.decoders import generate
    from dsbd_core.algorithm.policy.cost_model import CostController
    from dsbd_core.algorithm.sequences.penalties import bias_problem
    from dsbd_core.models import ModelSourceError, VocabularyMismatchError
    from dsbd_core.models.pair import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    uses_draft = drafts(args.method)
    try:
        device = resolve_device(args.device)
        pair = load_pair(
            args.target,
            args.draft if uses_draft else None,
            dtype=args.dtype,
            device=str(device),
            draft_options=options,
            decode_path=args.decode_path,
        )
        prompt_ids = pair.encode(args.prompt, chat=args.chat)
    except (ModelSourceError, VocabularyMismatchError, ValidationError, ValueError) as error:
        return fail(
            str(error).splitlines()[0] if isinstance(error, ValidationError) else str(error)
        )
    config = SamplingConfig(**{**config.model_dump(), "eos_token_ids": pair.stop_ids})
    say = (lambda _: None) if args.json else (lambda text: print(text, file=sys.stderr))
    controller = None
    if uses_draft and not args.fixed_knobs:
        calibration = pair.calibration(force=args.recalibrate, say=say)
        controller = CostController(config, calibration)
    target, draft = pair.scorers()
    problem = bias_problem(config.logit_bias, target.vocab_size)
    if problem is not None:
        return fail(f"--logit-bias: {problem}")
    capture = capture_static(target, draft, config, len(prompt_ids), say)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    stop = None
    if args.stop:
        from dsbd_core.algorithm.sequences.stops import StopStrings
        from dsbd_core.models.token_bytes import LoadedTexts, token_bytes

        texts = LoadedTexts(token_bytes(pair.target.tokenizer))
        stop = StopStrings(tuple(args.stop), texts)
    result = generate(
        args.method, target, prompt_ids, config, draft=draft, controller=controller, stop=stop
    )
    decode_s = time.perf_counter() - start
    report = _report(
        args, config, pair.target, pair.draft_name, prompt_ids, result, load_s, decode_s
    )
    report["models"] = pair.describe()
    report["dtype"] = pair.dtype_name
    report["knobs"] = "fixed" if controller is None else {"gamma": controller.chosen}
    report["decode_path"] = {"path": pair.decode_path, **capture}
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0


def _report(
    args: argparse.Namespace,
    config: SamplingConfig,
    target: LoadedModel,
    draft: str | None,
    prompt_ids: list[int],
    result: DecodeResult,
    load_s: float,
    decode_s: float,
) -> dict[str, Any]:
    """Everything one run says, as plain data (the `--json` output; the text view reads it)."""
    stats = result.stats

    def decode_text(ids: list[int], skip_special_tokens: bool) -> str:
        """A beam's text, cut before the first stop string in it (`--stop`)."""
        # one sequence's ids: one text
        text = cast(str, target.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        after = text_floor(
            lambda head: cast(
                str, target.tokenizer.decode(head, skip_special_tokens=skip_special_tokens)
            ),
            ids,
            config.min_tokens,
        )
        found = first_stop(text, args.stop, after) if args.stop else None
        return text[: found[0]] if found is not None else text

    return {
        "method": args.method,
        "target": target.name,
        "draft": draft,
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
                **(
                    {"token_logprobs": beam.token_logprobs, "top_logprobs": beam.top_logprobs}
                    if beam.token_logprobs is not None
                    else {}
                ),
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
        f"model load {report['load_s']:.2f} s\n{report['models']}"
    )
    if report["knobs"] != "fixed":
        print(f"draft depth per iteration (cost model): {report['knobs']['gamma']}")
    if report["config"]["epsilon"] > 0:
        print(
            f"epsilon {report['config']['epsilon']:g} (lossy: trades exactness for speed), "
            f"bias bound {stats['epsilon_bias_bound']:.3f}"
        )


def capture_static(
    target: object, draft: object, config: SamplingConfig, prompt_tokens: int, say: Any
) -> dict[str, Any]:
    """On CUDA, capture the static path's buckets before decoding (nothing a request should
    pay for) and print the ladder, capture time and graph memory; {} on the dynamic path."""
    from dsbd_core.models.static_scorer import StaticScorer

    report: dict[str, Any] = {}
    length = prompt_tokens + config.max_new_tokens + config.gamma + 2
    for name, scorer in (("target", target), ("draft", draft)):
        if isinstance(scorer, StaticScorer) and scorer.model.device.type == "cuda":
            status = scorer.capture(rows=config.width, length=length)
            say(
                f"{name} static path: buckets rows {status['row_buckets']} x slots "
                f"{status['slot_buckets']}, captured in {status['capture_s']:.1f} s, "
                f"graphs {status['graph_memory_mib']} MiB, KV pool {status['pool_mib']} MiB"
            )
            report[name] = status
    return report
