"""`dsbd` command line: decode one prompt in-process, manage models, judge and train drafts.

    dsbd generate --method dsbd --prompt "Why is the sky blue?"
    dsbd models prepare
    dsbd models install qwen-coder
    dsbd eval-acceptance --target smollm2 --draft smollm2-draft
    dsbd distill --target smollm2 --out drafts/mine
    dsbd theory simulate --out theory-out
    dsbd bench --pair smollm2 --quick
    dsbd bench serve --pair qwen-coder
    dsbd batch --input prompts.jsonl --output results.parquet

Every `SamplingConfig` field is a flag (`--top-p`, `--w-min`, ...); the flags are only parsed
here, the config model validates them, so the CLI and (later) HTTP reject the same values with
the same message. Usage and config errors exit with status 2, before any model is loaded.
Parsing imports neither torch, transformers nor Ray (`dsbd --help` answers at once;
tests/tools/test_layers.py checks): each command imports what it runs when it runs.

This module is the parser and the dispatch only; each subcommand's flags and handler live in
its own module of this package (generate_command, models_command, theory_command,
acceptance_command, distill_command, serve_command, bench_command, batch_command; the shared
SamplingConfig flags in sampling_flags; the `dsbd bench` subcommands in bench/). The CLI builds
the validated settings and passes them down to dsbd_core and deployments, which never import
`dsbd`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from dsbd import (
    acceptance_command,
    batch_command,
    bench_command,
    distill_command,
    generate_command,
    models_command,
    serve_command,
    theory_command,
)
from dsbd.sampling_flags import config_from_args

# `dsbd <command>` -> its handler (parsed namespace in, exit status out).
_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": generate_command.run,
    "models": models_command.run,
    "theory": theory_command.run,
    "eval-acceptance": acceptance_command.run,
    "distill": distill_command.run,
    "serve": serve_command.run,
    "bench": bench_command.run,
    "ray-env": lambda _args: serve_command.print_ray_env(),
    "batch": batch_command.run,
}


def build_parser() -> argparse.ArgumentParser:
    """The `dsbd` argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="dsbd", description="Dynamic-Width Speculative Beam Decoding, in-process."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # The order here is the order `dsbd --help` lists the commands in.
    generate_command.add_parser(commands)
    models_command.add_parser(commands)
    theory_command.add_parser(commands)
    acceptance_command.add_parser(commands)
    distill_command.add_parser(commands)
    serve_command.add_serve_parser(commands)
    bench_command.add_parser(commands)
    serve_command.add_ray_env_parser(commands)
    batch_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dsbd` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return _HANDLERS[args.command](args)


__all__ = ["build_parser", "config_from_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
