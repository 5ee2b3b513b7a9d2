"""`dsbd batch`: decode JSONL or Parquet files of prompts as a Ray Data job.

    dsbd batch --input prompts/ --output results.parquet [--width 3 --gamma 3 ...]

The job: the driver lists the input files (a file, or a directory of them) and makes one
streaming pass over them (deployments/batch_job/inputs.py): every row's id and content hash,
checked against the records the output already holds (deployments/batch_job/output.py), kept
as 16-byte fingerprints, never the rows. Ray Data then runs

    read_datasource(splits of the input) -> map_batches(BatchDecoder, ActorPoolStrategy(N))
        -> write

where read tasks read their split of a file themselves and pass on only the rows to decode
(deployments/batch_job/source.py), so rows stream from storage to the actors and the driver's
memory does not grow with the input; each actor loads target and draft once and decodes a
batch of rows together, sharing the models' forwards (deployments/batch_job/decoder.py); the
records are written as Parquet or JSON Lines, one file per write task, into the output
directory. A final line counts the rows decoded, failed and skipped, and the tokens per second.

The flags live in dsbd/batch_command.py, which checks every one before Ray starts (exit 2,
naming the flag and the value) and hands a `BatchJob` of already validated settings to
`run_job`; the output and model checks it calls (`check_output`, `check_models`) are here,
next to the manifest they read. Ray is started through `deployments.local_ray` (loopback only)
and shut down at the end, unless an address or `RAY_ADDRESS` names a running cluster (a KubeRay
RayJob: the entrypoint is `dsbd batch`), which is then only connected to, and disconnected from.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.batch_job.decoder import DecoderSettings
from deployments.batch_job.inputs import InputError, InputFile, InputPlan, plan_input
from deployments.batch_job.output import OutputDir

# Settings that decide a row's result; a re-run on the same output must repeat them.
_RESULT_SETTINGS = ("target", "draft", "dtype", "draft_variant", "fixed_knobs", "defaults")


class UsageError(Exception):
    """Bad command-line input: printed as `dsbd: error: ...`, exit status 2 (raised by the
    checks here and by dsbd/batch_command.py; the message names the flag)."""


class JobOptions(BaseModel):
    """How the job runs (not what it decodes): checked before Ray starts."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(1, ge=1, description="Actors (each loads target + draft).")
    batch_size: int = Field(8, ge=1, le=4096, description="Rows decoded together by an actor.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per actor.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per actor.")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray.")


@dataclass
class BatchJob:
    """A checked command line: the input files, the output, how actors load and run."""

    input: str  # --input as given (for messages)
    files: list[InputFile]
    out: OutputDir
    settings: DecoderSettings
    options: JobOptions


def run_job(job: BatchJob, *, address: str | None = None, progress: bool = True) -> int:
    """Run a checked job: plan the input against the output, decode the rows not done on Ray,
    write them, print the summary line; returns the exit status (1: Ray or the job failed,
    130: interrupted; rerunning resumes). Raises UsageError (before Ray starts) for input it
    cannot read. `address`: a Ray cluster, else $RAY_ADDRESS, else a local loopback-only Ray
    started (and shut down) for this job."""
    with interruptible():
        try:
            return _run(job, address, progress)
        except KeyboardInterrupt:  # whenever it lands: planning, the pipeline, the summary
            print("dsbd batch: interrupted; rerun the same command to resume", file=sys.stderr)
            return 130


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt inside, also in a process that started with SIGINT
    ignored. A shell without job control starts a background command (`cmd &` in a script, and
    everything that command starts) with SIGINT ignored; Python then installs no handler, the
    kernel drops Ctrl-C and `kill -INT`, and a job would decode everything and exit 0 instead of
    stopping with 130. SIG_DFL (which would kill the driver before it stops Ray) is replaced as
    well; a handler a caller installed is left as it is; what was found is put back at the end.
    Outside the main thread Python sets no handler and raises no KeyboardInterrupt: no change."""
    found = signal.getsignal(signal.SIGINT)
    main = threading.current_thread() is threading.main_thread()
    if not main or found not in (signal.SIG_IGN, signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)


def _run(job: BatchJob, address: str | None, progress: bool) -> int:
    """`run_job` less the interrupt handling: KeyboardInterrupt passes through."""
    out, settings, options = job.out, job.settings, job.options
    state = out.scan()
    started = time.perf_counter()
    try:
        plan = plan_input(job.files, state.final)
    except InputError as error:
        raise UsageError(f"--input {job.input!r}: {error}") from None
    skipped = plan.rows - plan.todo
    print(
        f"dsbd batch: {plan.rows} rows in {len(job.files)} file(s) ({plan.size / 1e6:.1f} MB) "
        f"planned in {time.perf_counter() - started:.1f} s: {plan.todo} to decode, {skipped} "
        "done before",
        file=sys.stderr,
    )
    if state.moved:
        print(
            f"dsbd batch: {len(state.moved)} incomplete file(s) moved to _incomplete/; "
            "their rows are decoded again",
            file=sys.stderr,
        )
    dropped = out.drop_stale(state.files, plan.redo, plan.keep)
    if dropped:
        print(
            f"dsbd batch: decoding again {dropped} row(s) that failed or changed since",
            file=sys.stderr,
        )
    out.write_manifest(_manifest(settings, out.fmt))
    if not plan.todo:
        print(
            f"dsbd batch: 0 rows decoded, 0 failed, {skipped} skipped (done before); "
            f"output: {out.uri}"
        )
        return 0
    run = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
    try:
        initialized_here = _start_ray(address, options)
    except Exception as error:  # e.g. no cluster at --address
        print(
            f"dsbd batch: cannot start or reach Ray: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 1
    try:
        start = time.perf_counter()
        _execute(plan, out, run, settings, options, progress=progress)
        seconds = time.perf_counter() - start
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
def check_models(settings: DecoderSettings) -> None:
    """Presets converted once here (not in every actor at once); unknown sources refused."""
    from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT
    from dsbd_core.models.errors import ModelSourceError
    from dsbd_core.models.sources import prepare_source

    for flag, source in (("--target", settings.target), ("--draft", settings.draft)):
        if flag == "--draft" and source == LOOKUP_DRAFT:
            continue  # the prompt-lookup draft: no weights
        try:
            prepare_source(source)
        except ModelSourceError as error:
            allowed = (
                f"; or {LOOKUP_DRAFT!r} (the prompt-lookup draft)" if flag == "--draft" else ""
            )
            raise UsageError(f"{flag} {source!r}: {error}{allowed}") from None


def check_output(out: OutputDir, settings: DecoderSettings, *, overwrite: bool) -> None:
    """Refuse an output that is not ours, or that other settings wrote (resuming would mix two
    configurations' results); raises UsageError naming --output."""
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


def _manifest(settings: DecoderSettings, fmt: str) -> dict[str, Any]:
    dumped = settings.model_dump(mode="json")
    return {"format": fmt, **{k: dumped[k] for k in _RESULT_SETTINGS}}


def _differences(now: Any, before: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(now, dict) and isinstance(before, dict):
        found = []
        for key in sorted(set(now) | set(before)):
            found += _differences(now.get(key), before.get(key), f"{path}.{key}".lstrip("."))
        return found
    return [] if now == before else [(path, now, before)]


# --------------------------------------------------------------------------- Ray
def _start_ray(address: str | None, options: JobOptions) -> bool:
    """Connect to a cluster (`address`, else $RAY_ADDRESS) or start a local loopback-only Ray;
    False if Ray was already up."""
    import ray

    if ray.is_initialized():  # a caller that runs Ray already (a notebook, the tests)
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, configure_logging=False)
        return True
    from deployments.local_ray import release_home, start_local_ray

    try:
        start_local_ray(num_cpus=options.ray_num_cpus, namespace="dsbd-batch")
    except BaseException:  # Ctrl-C or a failure midway: no Ray processes left behind
        ray.shutdown()
        release_home()
        raise
    return True


def _stop_ray(initialized_here: bool) -> None:
    """Disconnect from a cluster, or shut down the local Ray this job started (no Serve runs
    here: Serve's shutdown is skipped); a caller's Ray is left as it was."""
    if initialized_here:
        from deployments.local_ray import stop_local_ray

        stop_local_ray(shut_serve_down=False)


def _execute(
    plan: InputPlan,
    out: OutputDir,
    run: str,
    settings: DecoderSettings,
    options: JobOptions,
    *,
    progress: bool,
) -> None:
    """read (the plan's splits) -> map_batches (actor pool) -> write, a block per batch."""
    import ray

    from deployments.batch_job.decoder import BatchDecoder
    from deployments.batch_job.sink import JsonLinesDatasink, RunFiles
    from deployments.batch_job.source import BatchInputDatasource

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    context.enable_rich_progress_bars = progress
    context.use_ray_tqdm = False
    size = options.batch_size
    source = BatchInputDatasource(plan.splits, size)
    # Reads and writes reserve no CPU: with every CPU held by an actor they would otherwise
    # wait until the pool finishes (the pool would wait for rows forever), and a job killed
    # meanwhile would have written nothing. At most one read task per actor at a time: they
    # stream, and Ray Data's backpressure holds them back when the actors fall behind.
    light = {"num_cpus": 0}
    rows = ray.data.read_datasource(
        source,
        override_num_blocks=len(source.splits),  # no further splitting of the blocks
        concurrency=options.concurrency,
        ray_remote_args=light,
    )
    decoded = rows.map_batches(
        BatchDecoder,
        fn_constructor_kwargs={"settings": settings.model_dump()},
        batch_size=size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=options.concurrency),
        num_cpus=options.num_cpus,
        num_gpus=options.num_gpus or None,
    )
    if out.fmt == "parquet":
        files = RunFiles(run, "parquet")
        # a file per batch of rows: what an interrupted job loses, and resumes, is one batch
        decoded.write_parquet(
            out.uri, filename_provider=files, ray_remote_args=light, max_rows_per_file=size
        )
    else:
        decoded.write_datasink(JsonLinesDatasink(out.uri, run), ray_remote_args=light)


__all__ = [
    "BatchJob",
    "JobOptions",
    "UsageError",
    "check_models",
    "check_output",
    "interruptible",
    "run_job",
]
