"""`dsbd batch`: the flags of the Ray Data batch job, and their checks.

    dsbd batch --input prompts/ --output results.parquet [--width 3 --gamma 3 ...]

Every flag is checked here before Ray starts (exit 2, naming the flag and the value): the
SamplingConfig flags become the row defaults, the Ray flags `JobOptions`, the input files are
listed and the output checked; the resulting `BatchJob` goes to deployments.batch_job.job.run_job,
which plans the input (an input it cannot read is exit 2 too, still before Ray) and runs the
pipeline (see there and docs/BATCH.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from deployments.batch_job.output import EXTENSIONS, OutputDir, OutputFormat
from deployments.batch_job.rows import INPUT_SUFFIXES
from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET, add_pair_flags, fail
from dsbd.sampling_flags import add_config_flags, config_from_args
from dsbd_core.algorithm.config import error_words
from dsbd_core.algorithm.methods import METHODS, method_config

if TYPE_CHECKING:
    from deployments.batch_job.job import BatchJob

# The job's modules (its decoder imports torch and transformers' model code) are imported by
# `run` and the checks: `dsbd --help` and every other command parse without them.


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd batch`: its own flags, then the SamplingConfig ones (as for generate)."""
    batch = commands.add_parser(
        "batch",
        help="decode JSONL/Parquet files of prompts as a Ray Data job (resumable)",
        description="Read prompts (a JSONL or Parquet file, or a directory of them, streamed "
        "through Ray Data), decode them on an actor pool that holds "
        "target + draft (rows of a batch share forwards), write one record per row (beams, "
        "stats or error) as Parquet or JSONL. Re-run to resume: done ids are skipped. Row "
        "fields override the sampling flags below. See docs/BATCH.md.",
    )
    add_arguments(batch)
    add_config_flags(batch)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch flags besides SamplingConfig's (`add_parser` adds those, as for generate)."""
    io = parser.add_argument_group("input and output")
    suffixes = ", ".join(INPUT_SUFFIXES)
    io.add_argument(
        "--input",
        required=True,
        help=f"prompts: a file ({suffixes}) or a directory of such files (read recursively, "
        "in path order); local or URI",
    )
    io.add_argument(
        "--output",
        required=True,
        help="output directory; its suffix (.parquet, .jsonl) picks the format",
    )
    io.add_argument(
        "--format",
        choices=tuple(EXTENSIONS),
        help="output format (default: --output's suffix, else parquet)",
    )
    io.add_argument(
        "--overwrite",
        action="store_true",
        help="delete what --output holds and decode every row (default: resume, skip done ids)",
    )
    model = parser.add_argument_group("models and row defaults (a row's own fields win)")
    model.add_argument("--method", choices=METHODS, default="dsbd", help="default: dsbd")
    model.add_argument("--target", default=DEFAULT_TARGET, help="preset, dir, .gguf or hub id")
    model.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="draft model; same vocabulary; or 'ngram': the prompt-lookup draft (no weights)",
    )
    model.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="chat-template `prompt` rows (default: when the tokenizer has a template)",
    )
    model.add_argument("--n", type=int, help="beams per record, best first (default: all)")
    model.add_argument(
        "--max-prompt-tokens", type=int, default=4096, help="longer prompts are error records"
    )
    add_pair_flags(parser)  # --dtype, the draft's variant, --fixed-knobs, --recalibrate
    _add_ray_arguments(parser.add_argument_group("Ray"))


def _add_ray_arguments(ray: argparse._ArgumentGroup) -> None:
    """Where the job runs and how its actors are sized (`JobOptions`)."""
    ray.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster ('auto', or host:port); default: $RAY_ADDRESS, else a "
        "local loopback-only Ray started for this job",
    )
    ray.add_argument("--concurrency", type=int, default=1, help="actors (default: 1)")
    ray.add_argument("--batch-size", type=int, default=8, help="rows per actor call (default: 8)")
    ray.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per actor (default: 1)")
    ray.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        help="GPUs per actor (default: 1 with --device cuda, else 0)",
    )
    ray.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    ray.add_argument("--threads", type=int, help="torch threads per actor (default: --num-cpus)")
    ray.add_argument("--ray-num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    ray.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """`dsbd batch`: check everything, then run the job; returns the exit status (130 for
    Ctrl-C, also during the checks, e.g. while a preset is converted)."""
    from deployments.batch_job.job import UsageError, interruptible, run_job

    with interruptible():
        try:
            job = _plan(args)
            return run_job(job, address=args.address, progress=not args.no_progress)
        except UsageError as error:
            return fail(str(error))
        except KeyboardInterrupt:  # during the checks; run_job answers for the job itself
            print("dsbd batch: interrupted before the job started", file=sys.stderr)
            return 130


def _plan(args: argparse.Namespace) -> BatchJob:
    """Everything checked and read before Ray starts; raises UsageError."""
    from deployments.batch_job.decoder import DecoderSettings, RowDefaults, check_n
    from deployments.batch_job.inputs import InputError, find_input
    from deployments.batch_job.job import (
        BatchJob,
        JobOptions,
        UsageError,
        check_models,
        check_output,
    )
    from dsbd_core.models.options import DraftOptions

    try:
        listing = find_input(args.input)
    except InputError as error:
        raise UsageError(f"--input {args.input!r}: {error}") from None
    except (OSError, ValueError) as error:  # no permission, an unreachable bucket, a bad URI
        raise UsageError(f"--input {args.input!r}: cannot read it: {error}") from None
    ignored = listing.ignored
    if ignored:
        shown = ", ".join(ignored[:3]) + (", ..." if len(ignored) > 3 else "")
        print(
            f"dsbd batch: --input {args.input!r}: left out {len(ignored)} file(s) of other "
            f"suffixes ({shown}); read: {', '.join(INPUT_SUFFIXES)}",
            file=sys.stderr,
        )
    out_fmt = _output_format(args.output, args.format)
    try:
        config = config_from_args(args)
    except ValidationError as error:
        raise UsageError(_flag_errors(error)) from None
    if args.n is not None:
        try:
            check_n(args.n, args.method, method_config(args.method, config))
        except ValueError as error:
            raise UsageError(f"--n: {error}") from None
    num_gpus = args.num_gpus if args.num_gpus is not None else float(args.device == "cuda")
    try:
        options = JobOptions(
            concurrency=args.concurrency,
            batch_size=args.batch_size,
            num_cpus=args.num_cpus,
            num_gpus=num_gpus,
            ray_num_cpus=args.ray_num_cpus,
        )
        threads = args.threads if args.threads is not None else max(1, int(args.num_cpus))
        defaults = RowDefaults(
            method=args.method,
            n=args.n,
            chat=args.chat,
            max_prompt_tokens=args.max_prompt_tokens,
            config=config.model_dump(exclude={"eos_token_ids"}),
        )
        settings = DecoderSettings(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype,
            device=args.device,
            decode_path=args.decode_path,
            threads=threads,
            draft_variant=DraftOptions(
                quantize=args.draft_quantize,
                head_tokens=args.draft_head_tokens,
                ngram_max=args.ngram_max,
            ),
            fixed_knobs=args.fixed_knobs,
            recalibrate=args.recalibrate,
            defaults=defaults,
        )
    except ValidationError as error:
        raise UsageError(_flag_errors(error)) from None
    local = not (args.address or os.environ.get("RAY_ADDRESS"))
    cpus = options.ray_num_cpus or os.cpu_count() or 1
    if local and options.concurrency * options.num_cpus > cpus:
        raise UsageError(
            f"--concurrency={options.concurrency} x --num-cpus={options.num_cpus:g} needs more "
            f"CPUs than the local Ray's {cpus} (--ray-num-cpus); the actors would wait forever"
        )
    if args.device == "cuda" and num_gpus <= 0:
        raise UsageError(f"--num-gpus={num_gpus:g}: --device cuda needs a GPU per actor")
    out = OutputDir(args.output, out_fmt)
    directory = listing.directory
    if directory is not None and (out.path + "/").startswith(directory.rstrip("/") + "/"):
        raise UsageError(
            f"--output {args.output!r} is inside --input {args.input!r}: its records would be "
            "read as prompts; allowed: an output directory outside the input"
        )
    check_output(out, settings, overwrite=args.overwrite)
    check_models(settings)
    if args.overwrite:
        out.clear()
    return BatchJob(args.input, listing.files, out, settings, options)


def _output_format(path: str, flag: OutputFormat | None) -> OutputFormat:
    from deployments.batch_job.job import UsageError

    name = path.rstrip("/").rsplit("/", 1)[-1]
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    by_suffix: dict[str, OutputFormat] = {
        ".parquet": "parquet",
        ".jsonl": "jsonl",
        ".ndjson": "jsonl",
    }
    if suffix and suffix not in by_suffix:
        raise UsageError(
            f"--output {path!r}: unknown suffix {suffix!r}; allowed: "
            f"{', '.join(by_suffix)} or none (then --format, default parquet)"
        )
    named = by_suffix.get(suffix)
    if flag is not None and named is not None and flag != named:
        raise UsageError(f"--format {flag} contradicts --output {path!r} ({named})")
    return flag or named or "parquet"


def _flag_errors(error: ValidationError) -> str:
    """pydantic errors as `--flag=value: what is allowed` (one line each)."""
    lines = []
    for item in error.errors():
        parts = [str(p) for p in item["loc"] if p not in ("defaults", "config")]
        flag = "--" + parts[-1].replace("_", "-") if parts else "flags"
        value = item.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{flag}{shown}: {error_words(item)}")
    return "\n".join(lines)
