"""The `SamplingConfig` flags of `dsbd generate` and `dsbd batch` (`--top-p`, `--w-min`, ...).

Every `SamplingConfig` field is a flag; the flags are only parsed here, the config model
validates them, so the CLI and HTTP reject the same values with the same message. The CLI
builds the config and passes it down (deployments.batch_job.job receives it inside its settings), so
nothing below the CLI reads argparse namespaces.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, get_args

from dsbd_core.algorithm.config import Mode, SamplingConfig, Selection


def _optional_float(text: str) -> float | None:
    """`--threshold none` means fixed width (threshold=None)."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _optional_int(text: str) -> int | None:
    """`--logprobs none` tracks nothing (the default)."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _early_stopping(text: str) -> bool | str:
    """`--early-stopping true|false|never` (transformers' values)."""
    value = text.lower()
    if value in ("true", "false"):
        return value == "true"
    if value == "never":
        return value
    raise argparse.ArgumentTypeError(f"expected true, false or never, got {text!r}")


def _bias_pair(text: str) -> tuple[int, float]:
    """`--logit-bias ID=BIAS` (repeatable): one logit_bias entry."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TOKEN_ID=BIAS (e.g. 42=-100), got {text!r}"
        ) from None


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
    "early_stopping": _early_stopping,
    "logprobs": _optional_int,
    "min_tokens": int,
    "frequency_penalty": float,
    "presence_penalty": float,
    "repetition_penalty": float,
}
_BOOL_FIELDS = ("lean_memory", "search")
_NOT_FLAGS = ("eos_token_ids",)  # read from the target's tokenizer and generation config


def add_config_flags(parser: argparse.ArgumentParser) -> None:
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
        elif name == "selection":
            kind = {"choices": get_args(Selection)}
        elif name == "logit_bias":
            kind = {"type": _bias_pair, "action": "append", "metavar": "ID=BIAS"}
        else:
            parse = _FIELD_TYPES[name]
            metavar = {
                int: "N",
                float: "X",
                _optional_float: "T|none",
                _optional_int: "N|none",
                _early_stopping: "true|false|never",
            }[parse]
            kind = {"type": parse, "metavar": metavar}
        group.add_argument(flag, default=argparse.SUPPRESS, help=help_text, **kind)


def config_from_args(args: argparse.Namespace) -> SamplingConfig:
    """SamplingConfig from the flags the user gave (raises pydantic's ValidationError).

    Config flags default to `argparse.SUPPRESS`, so an absent flag is an absent attribute and
    the model's own default applies, while `--threshold none` still sets threshold=None.
    """
    given = {
        name: getattr(args, name) for name in SamplingConfig.model_fields if hasattr(args, name)
    }
    return SamplingConfig(**given)
