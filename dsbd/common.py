"""What several `dsbd` subcommands share: the default model pair, `--device`, the error line.

Kept apart so that each subcommand module depends only on this and on the layers below
(dsbd_core, deployments), never on another subcommand.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT = "smollm2-draft"


def fail(message: str) -> int:
    """Print `dsbd: error: <message>` on stderr; returns 2, the exit status of bad input."""
    print(f"dsbd: error: {message}", file=sys.stderr)
    return 2


def ray_cpus(text: str) -> int:
    """`--num-cpus` of a local Ray: a whole number >= 1 (Ray refuses fractional node
    resources with a traceback; here argparse names the flag and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: allowed: a whole number >= 1")
    return value


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """`--device`, read by `resolve_device` (eval-acceptance and distill)."""
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when available, else cpu), cpu, cuda or cuda:N (default: auto)",
    )


def resolve_device(flag: str) -> torch.device:
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


def add_pair_flags(parser: argparse.ArgumentParser, *, knobs: bool = True) -> None:
    """How the models run: dtype, the draft's variant, the cost model's calibration and (when
    `knobs`) --fixed-knobs; one definition for generate, batch and bench."""
    group = parser.add_argument_group("models")
    group.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16", "float64"),
        default="auto",
        help="auto (default): bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else float32",
    )
    group.add_argument(
        "--draft-quantize",
        choices=("auto", "none", "int8"),
        default="auto",
        help="int8 dynamic quantisation of the draft's linear layers (exact either way); "
        "auto (default): where it measures faster on this CPU",
    )
    group.add_argument(
        "--draft-head-tokens",
        type=int,
        default=None,
        metavar="K",
        help="restrict the draft's head to the K most frequent tokens (exact either way); "
        "0: the full head; default: 32768 for vocabularies over 65536, else the full head",
    )
    group.add_argument(
        "--ngram-max",
        type=int,
        default=3,
        metavar="N",
        help="--draft ngram (the prompt-lookup draft: no weights, drafts from the text "
        "itself) only: the longest suffix it matches, 1..16 (default: 3)",
    )
    group.add_argument(
        "--decode-path",
        choices=("auto", "dynamic", "static"),
        default="auto",
        help="dynamic: packed forests over growing caches; static: fixed-shape buckets over a "
        "preallocated KV pool, captured as CUDA graphs on CUDA; auto (default): static on "
        "CUDA, dynamic on CPU",
    )
    if knobs:
        group.add_argument(
            "--fixed-knobs",
            action="store_true",
            help="draft exactly --gamma layers of --draft-width beams every iteration, instead "
            "of the cost model choosing the depth per iteration (reproducible experiments)",
        )
    group.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the cost model's forward costs again (else they are read from the "
        "cache where this machine measured them once)",
    )
