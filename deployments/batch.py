"""`dsbd batch`: decode a JSONL or Parquet file of prompts as a Ray Data job.

    dsbd batch --input prompts.jsonl --output results.parquet [--width 3 --gamma 3 ...]

The job: the driver reads the input (deployments/batch_rows.py) and leaves out the rows the
output already holds (deployments/batch_output.py); Ray Data then runs

    from_arrow(rows) -> map_batches(BatchDecoder, compute=ActorPoolStrategy(size=N)) -> write

where each actor loads target and draft once and decodes a batch of rows together, sharing the
models' forwards (deployments/batch_decoder.py); the records are written as Parquet or JSON
Lines, one file per write task, into the output directory. A final line counts the rows decoded,
failed and skipped, and the tokens per second.

Every flag is checked before Ray starts (exit 2, naming the flag and the value). Ray is started
through `deployments.local_ray` (loopback only) and shut down at the end, unless `--address` or
`RAY_ADDRESS` names a running cluster (a KubeRay RayJob: the entrypoint is this command), which
is then only connected to, and disconnected from.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.batch_decoder import DecoderSettings, RowDefaults, check_n
from deployments.batch_output import EXTENSIONS, OutputDir, OutputFormat
from deployments.batch_rows import INPUT_SUFFIXES, InputRows, input_format, read_input
from dsbd_core.algorithm.decoders import METHODS, method_config

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT = "smollm2-draft"
# Settings that decide a row's result; a re-run on the same output must repeat them.
_RESULT_SETTINGS = ("target", "draft", "dtype", "defaults")


class UsageError(Exception):
    """Bad command-line input: printed as `dsbd: error: ...`, exit status 2."""


class JobOptions(BaseModel):
    """How the job runs (not what it decodes): checked before Ray starts."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(1, ge=1, description="Actors (each loads target + draft).")
    batch_size: int = Field(8, ge=1, le=4096, description="Rows decoded together by an actor.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per actor.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per actor.")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch flags besides SamplingConfig's (dsbd/cli.py adds those, as for generate)."""
    io = parser.add_argument_group("input and output")
    suffixes = ", ".join(INPUT_SUFFIXES)
    io.add_argument("--input", required=True, help=f"prompts file ({suffixes}); local or URI")
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
    model.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model; same vocabulary")
    model.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="chat-template `prompt` rows (default: when the tokenizer has a template)",
    )
    model.add_argument("--n", type=int, help="beams per record, best first (default: all)")
    model.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float64"),
        default="float32",
        help="model weights and activations (default: float32)",
    )
    model.add_argument(
        "--max-prompt-tokens", type=int, default=4096, help="longer prompts are error records"
    )
    ray = parser.add_argument_group("Ray")
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


def main(args: argparse.Namespace) -> int:
    """Run the job; returns the exit status."""
    try:
        job = _plan(args)
    except UsageError as error:
        print(f"dsbd: error: {error}", file=sys.stderr)
        return 2
    rows, out, settings, options = job.rows, job.out, job.settings, job.options
    state = out.scan()
    keys = rows.keys()
    pending = state.pending(keys)
    skipped = len(rows) - len(pending)
    if state.moved:
        print(
            f"dsbd batch: {len(state.moved)} incomplete file(s) moved to _incomplete/; "
            "their rows are decoded again",
            file=sys.stderr,
        )
    keep = state.final & set(keys)
    dropped = out.drop_stale(state.files, {rows.id[i] for i in pending}, keep)
    if dropped:
        print(
            f"dsbd batch: decoding again {dropped} row(s) that failed or changed since",
            file=sys.stderr,
        )
    out.write_manifest(_manifest(settings, out.fmt))
    if not pending:
        print(
            f"dsbd batch: 0 rows decoded, 0 failed, {skipped} skipped (done before); "
            f"output: {out.uri}"
        )
        return 0
    run = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
    try:
        initialized_here = _start_ray(args, options)
    except Exception as error:  # e.g. no cluster at --address
        print(
            f"dsbd batch: cannot start or reach Ray: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 1
    try:
        start = time.perf_counter()
        _execute(rows.table(pending), out, run, settings, options, progress=not args.no_progress)
        seconds = time.perf_counter() - start
    except KeyboardInterrupt:
        print("dsbd batch: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as error:
        print(
            f"dsbd batch: the job failed: {type(error).__name__}: {error}\n"
            "rerun the same command to resume",
            file=sys.stderr,
        )
        return 1
    finally:
        _stop_ray(initialized_here)
    done = out.summary(run)
    rate = done["tokens"] / seconds if seconds > 0 else 0.0
    print(
        f"dsbd batch: {done['decoded']} rows decoded, {done['failed']} failed, {skipped} skipped "
        f"(done before); {done['tokens']} tokens in {seconds:.1f} s ({rate:.1f} tokens/s, model "
        f"loading included); output: {out.uri}"
    )
    return 0


# --------------------------------------------------------------------------- checks
@dataclass
class _Job:
    """A checked command line: the input rows, the output, how actors load and run."""

    rows: InputRows
    out: OutputDir
    settings: DecoderSettings
    options: JobOptions


def _plan(args: argparse.Namespace) -> _Job:
    """Everything checked and read before Ray starts; raises UsageError."""
    from dsbd.cli import config_from_args

    in_fmt = input_format(args.input)
    if in_fmt is None:
        raise UsageError(
            f"--input {args.input!r}: unknown suffix; allowed: {', '.join(INPUT_SUFFIXES)}"
        )
    if not _exists(args.input):
        raise UsageError(f"--input {args.input!r}: no such file")
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
            threads=threads,
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
    _check_output(out, settings, overwrite=args.overwrite)
    _check_models(settings)
    try:
        rows = read_input(args.input, in_fmt)
    except FileNotFoundError:
        raise UsageError(f"--input {args.input!r}: no such file") from None
    except Exception as error:  # unreadable Parquet, a directory, no permission ...
        raise UsageError(f"--input {args.input!r}: cannot read it: {error}") from None
    if args.overwrite:
        out.clear()
    return _Job(rows, out, settings, options)


def _exists(path: str) -> bool:
    import pyarrow.fs as pafs

    from deployments.batch_rows import uri

    filesystem, where = pafs.FileSystem.from_uri(uri(path))
    return filesystem.get_file_info(where).type != pafs.FileType.NotFound


def _output_format(path: str, flag: str | None) -> OutputFormat:
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
        lines.append(f"{flag}{shown}: {item['msg']}")
    return "\n".join(lines)


def _check_models(settings: DecoderSettings) -> None:
    """Presets converted once here (not in every actor at once); unknown sources refused."""
    from dsbd_core.models import ModelSourceError, resolve_source

    for flag, source in (("--target", settings.target), ("--draft", settings.draft)):
        try:
            resolve_source(source)
        except ModelSourceError as error:
            raise UsageError(f"{flag} {source!r}: {error}") from None


def _manifest(settings: DecoderSettings, fmt: str) -> dict[str, Any]:
    dumped = settings.model_dump(mode="json")
    return {"format": fmt, **{k: dumped[k] for k in _RESULT_SETTINGS}}


def _check_output(out: OutputDir, settings: DecoderSettings, *, overwrite: bool) -> None:
    kind = out.kind()
    if kind == "file":
        raise UsageError(
            f"--output {out.uri!r} is a file; allowed: a directory (new or a "
            "previous dsbd batch output)"
        )
    if kind == "missing" or not out.entries():
        return
    manifest = out.read_manifest()
    if manifest is None:
        raise UsageError(
            f"--output {out.uri!r} is a non-empty directory that no dsbd batch "
            "wrote (no _dsbd_batch.json); allowed: a new or empty directory"
        )
    if overwrite:
        return
    if manifest.get("format") != out.fmt or out.foreign_files():
        raise UsageError(
            f"--output {out.uri!r} holds {manifest.get('format')} records; this run "
            f"writes {out.fmt}: use the same --format, or --overwrite"
        )
    wanted = _manifest(settings, out.fmt)
    for key, value, before in _differences(wanted, manifest):
        raise UsageError(
            f"--output {out.uri!r} was written with {key}={before!r}, this run asks {key}="
            f"{value!r}; allowed: the same settings to resume, --overwrite, or another --output"
        )


def _differences(now: Any, before: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(now, dict) and isinstance(before, dict):
        found = []
        for key in sorted(set(now) | set(before)):
            found += _differences(now.get(key), before.get(key), f"{path}.{key}".lstrip("."))
        return found
    return [] if now == before else [(path, now, before)]


# --------------------------------------------------------------------------- Ray
def _start_ray(args: argparse.Namespace, options: JobOptions) -> bool:
    """Connect to a cluster or start a local loopback-only Ray; False if Ray was already up."""
    import ray

    if ray.is_initialized():  # a caller that runs Ray already (a notebook, the tests)
        return False
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, configure_logging=False)
        return True
    from deployments.local_ray import start_local_ray

    start_local_ray(num_cpus=options.ray_num_cpus, namespace="dsbd-batch")
    return True


def _stop_ray(initialized_here: bool) -> None:
    """Disconnect from a cluster, or shut down the local Ray this job started (no Serve runs
    here, so not `stop_local_ray`, which would say so); a caller's Ray is left as it was."""
    if initialized_here:
        import ray

        ray.shutdown()


def _execute(
    table: Any,
    out: OutputDir,
    run: str,
    settings: DecoderSettings,
    options: JobOptions,
    *,
    progress: bool,
) -> None:
    """read -> map_batches (actor pool) -> write, one block per batch of rows."""
    import ray

    from deployments.batch_decoder import BatchDecoder
    from deployments.batch_sink import JsonLinesDatasink, RunFiles

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    context.enable_rich_progress_bars = progress
    context.use_ray_tqdm = False
    size = options.batch_size
    blocks = [table.slice(start, size) for start in range(0, table.num_rows, size)]
    decoded = ray.data.from_arrow(blocks).map_batches(
        BatchDecoder,
        fn_constructor_kwargs={"settings": settings.model_dump()},
        batch_size=size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=options.concurrency),
        num_cpus=options.num_cpus,
        num_gpus=options.num_gpus or None,
    )
    # Writes reserve no CPU: with every CPU held by an actor they would otherwise wait until
    # the pool finishes, and a job killed meanwhile would have written nothing.
    light = {"num_cpus": 0}
    if out.fmt == "parquet":
        files = RunFiles(run, "parquet")
        decoded.write_parquet(out.uri, filename_provider=files, ray_remote_args=light)
    else:
        decoded.write_datasink(JsonLinesDatasink(out.uri, run), ray_remote_args=light)


__all__ = ["add_arguments", "main"]
