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
