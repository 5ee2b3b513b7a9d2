"""`dsbd` command line: decode one prompt in-process, and prepare the embedded models.

    dsbd generate --method dsbd --prompt "Why is the sky blue?"
    dsbd models prepare

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

from dsbd_core.config import Mode, SamplingConfig, config_error_message
from dsbd_core.decoders import METHODS, METHODS_WITH_DRAFT, generate

if TYPE_CHECKING:
    from dsbd_core.models import LoadedModel
    from dsbd_core.result import DecodeResult

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
}
_BOOL_FIELDS = ("lean_memory",)
_NOT_FLAGS = ("eos_token_ids",)  # read from the target's tokenizer and generation config


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingConfig field; help text and defaults come from the model itself."""
    group = parser.add_argument_group("sampling (dsbd_core.config.SamplingConfig)")
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
    return parser


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
        return _prepare_models(args.presets)
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

    from dsbd_core.transformer_scorer import TransformerScorer

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


if __name__ == "__main__":
    sys.exit(main())
