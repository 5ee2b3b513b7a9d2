"""`dsbd batch` reads through Ray Data: a directory of JSONL and Parquet files streams to the
actors, the driver's memory stays flat as the input grows, an interrupted job resumes exactly.

Without Ray: which files a directory holds and in which order; that the planned splits read
back the rows of the files concatenated, with the same ids as one JSONL file of those rows
(the index is the global position); duplicates across files; resume marks; a file changed
after planning. With Ray (one test, the real `dsbd batch` in subprocesses, its local Ray
included): the driver's peak RSS for an input and for one 10x larger, a run interrupted
(SIGINT, as Ctrl-C, once a record is on disk), its resume interrupted too while started with
SIGINT ignored (as a shell without job control starts `dsbd batch &`), and the last run
completing it with every row exactly once in the output. The input's size comes from long
prompts that are refused after tokenization (`--max-prompt-tokens`), so the decoding stays
small. Without Ray: `interruptible` (SIGINT raised however the process started) and Ctrl-C
during planning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import deployments.batch_job.inputs as batch_input
from deployments.batch_job.inputs import InputError, find_input, plan_input, split_rows
from deployments.batch_job.keys import KeySet
from deployments.batch_job.rows import input_format
from dsbd.cli import main
from tests.support.serving_harness import leftovers
from tests.support.tiny_models import build_pair

REPO = Path(__file__).parents[2]


# --------------------------------------------------------------------------- helpers
def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 1 << 20) -> None:
    """Rows as a Parquet file: one column per field, nulls where a row lacks it."""
    names = sorted({k for r in rows for k in r})
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({k: [r.get(k) for r in rows] for k in names})
    pq.write_table(table, path, row_group_size=row_group_size)


def expected_texts(path: Path) -> list[str]:
    """A file's rows as text, read independently of the code under test: JSONL lines (BOM
    dropped, CRLF too, blank lines skipped), Parquet rows dumped as JSON."""
    if input_format(path.name) == "parquet":
        return [json.dumps(r, default=str) for r in pq.read_table(path).to_pylist()]
    lines = path.read_bytes().decode("utf-8-sig").split("\n")
    return [line.removesuffix("\r") for line in lines if line.strip()]


def expected_id(text: str, index: int) -> str:
    """docs/BATCH.md, Ids: the row's own id, else row<index>-<SHA-256 of canonical JSON>."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return f"row{index}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if isinstance(value.get("id"), str | int):
        return str(value["id"])
    value = {k: v for k, v in value.items() if v is not None}
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return f"row{index}-{hashlib.sha256(canonical).hexdigest()[:12]}"


def read_plan(plan: Any) -> list[dict[str, Any]]:
    """Every row the plan's splits yield, as the read tasks would (no Ray needed)."""
    return [row for split in plan.splits for row in split_rows(split)]


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """A directory of JSONL and Parquet files (nested, odd suffix case, BOM, CRLF, blank and
    bad lines, a long line, an id repeated across files) and files that must be left out."""
    root = tmp_path / "prompts"
    (root / "b").mkdir(parents=True)
    lines = [
        '{"id": "dup", "prompt": "first"}',
        "",
        '{"prompt": "alpha", "seed": 1}',
        "not json {",
        '{"prompt": "x", "widht": 2}',
        '{"prompt": "y", "width": 0}',
    ]
    (root / "a.ndjson").write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())
    write_parquet(
        root / "b/part-0.parquet",
        [{"prompt": f"p{i}", "seed": i, "width": 2 if i % 3 else None} for i in range(7)],
        row_group_size=2,
    )
    long_line = json.dumps({"prompt": "long " * 40, "n": 1})
    (root / "b/part-1.jsonl").write_text(
        f'{long_line}\n\n   \n{{"id": "dup", "prompt": "second"}}\n{{"id": 7, "prompt": "z"}}'
    )  # no newline at the end
    write_parquet(root / "D.JSONL.parquet", [{"prompt": "upper", "chat": False}])
    (root / "E.JSONL").write_text('{"prompt": "suffix in capitals"}\n')
    for hidden in ("_SUCCESS", ".hidden.jsonl", "_tmp/x.jsonl", ".git/y.parquet"):
        (root / hidden).parent.mkdir(parents=True, exist_ok=True)
        (root / hidden).write_text('{"prompt": "never read"}\n')
    (root / "notes.txt").write_text("not an input file\n")
    return root


# --------------------------------------------------------------------------- without Ray
def test_a_directory_reads_as_its_files_concatenated(mixed: Path, monkeypatch) -> None:
    listing = find_input(str(mixed))
    files, ignored = listing.files, listing.ignored
    order = ["D.JSONL.parquet", "E.JSONL", "a.ndjson", "b/part-0.parquet", "b/part-1.jsonl"]
    assert [f.name for f in files] == order  # code-point order of the relative path
    assert ignored == ["notes.txt"]
    texts = [t for name in order for t in expected_texts(mixed / name)]

    monkeypatch.setattr(batch_input, "CHUNK_BYTES", 16)  # lines span many chunks
    plan = plan_input(files, KeySet(), split_bytes=64)  # several splits per file
    assert len(plan.splits) > len(files) and plan.rows == plan.todo == len(texts)
    assert [s.first for s in plan.splits] == sorted(s.first for s in plan.splits)
    rows = read_plan(plan)
    assert [r["index"] for r in rows] == list(range(len(texts)))
    assert [r["row"] for r in rows] == texts
    assert [r["id"] for r in rows] == [expected_id(t, i) for i, t in enumerate(texts)]

    # The same rows as one JSONL file: the same ids, hashes and rows (index = position).
    one = mixed.parent / "one.jsonl"
    one.write_text("".join(t + "\n" for t in texts))
    alone = read_plan(plan_input(find_input(str(one)).files, KeySet()))
    assert alone == rows

    # An id repeated in a later file: the later row is refused, naming the first.
    dups = [r for r in rows if r["id"] == "dup"]
    assert [r["problem"] is None for r in dups] == [True, False]
    first = dups[0]["index"]
    assert dups[1]["problem"] == f"id='dup' is also the id of row {first}; ids must be unique"


def test_the_plan_skips_done_rows_and_knows_what_resume_drops(mixed: Path) -> None:
    files = find_input(str(mixed)).files
    every = read_plan(plan_input(files, KeySet()))
    done = {(r["id"], r["row_hash"]) for r in every if r["index"] % 2 == 0}
    done.add(("from-another-input", "0123456789ab"))
    plan = plan_input(files, KeySet.of(done), split_bytes=100)
    rows = read_plan(plan)
    assert [r["index"] for r in rows] == [r["index"] for r in every if r["index"] % 2]
    assert plan.todo == len(rows) and plan.rows == len(every)
    assert len(plan.keep) == len(done) - 1  # the other input's record is no row of this one
    assert all(r["id"] in plan.redo for r in rows)
    assert not any(key in plan.keep for key in {(r["id"], r["row_hash"]) for r in rows})
    everything = plan_input(files, KeySet.of(done | {(r["id"], r["row_hash"]) for r in rows}))
    assert everything.todo == 0 and not [s for s in everything.splits if s.todo]


def test_a_file_changed_after_planning_fails_its_read(mixed: Path) -> None:
    files = find_input(str(mixed)).files
    plan = plan_input(files, KeySet())
    with (mixed / "E.JSONL").open("a") as f:
        f.write('{"prompt": "appended"}\n')
    with pytest.raises(InputError, match="E.JSONL changed since the job planned it"):
        read_plan(plan)


def test_missing_empty_or_unreadable_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        find_input(str(tmp_path / "missing.jsonl"))
    with pytest.raises(InputError, match="unknown suffix; allowed: .jsonl, .ndjson, .parquet"):
        find_input(str(tmp_path / "prompts.csv"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="a directory without input files"):
        find_input(str(tmp_path / "empty"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    files = find_input(str(tmp_path / "bad.parquet")).files
    with pytest.raises(InputError, match="bad.parquet: cannot read it"):
        plan_input(files, KeySet())


def test_the_cli_refuses_bad_input_before_ray_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    import deployments.batch_job.job

    def no_ray(*_: Any) -> None:
        raise AssertionError("Ray was started for an input that cannot be read")

    monkeypatch.setattr(deployments.batch_job.job, "_start_ray", no_ray)
    target, draft = build_pair(tmp_path / "models")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("x")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    argv = ["batch", "--target", str(target), "--draft", str(draft), "--output"]
    assert main([*argv, str(tmp_path / "o1.jsonl"), "--input", str(tmp_path / "in")]) == 2
    assert "in': a directory without input files" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "o2.jsonl"), "--input", str(tmp_path / "bad.parquet")]) == 2
    assert "bad.parquet': bad.parquet: cannot read it" in capsys.readouterr().err
    (tmp_path / "in" / "a.jsonl").write_text('{"prompt": "x"}\n')
    assert main([*argv, str(tmp_path / "in" / "out.jsonl"), "--input", str(tmp_path / "in")]) == 2
    assert "is inside --input" in capsys.readouterr().err
    assert not (tmp_path / "in" / "out.jsonl").exists()


def test_the_rayjob_reads_a_directory() -> None:
    from dsbd.cli import build_parser

    text = (REPO / "cluster" / "rayjob-batch.yaml").read_text()
    entrypoint = text.split("entrypoint: >-", 1)[1].split("submissionMode", 1)[0]
    args = build_parser().parse_args(shlex.split(" ".join(entrypoint.split()))[1:])
    assert args.input.startswith("/data/") and input_format(args.input) is None, args.input


# --------------------------------------------------------------------------- with Ray
FLAGS = [
    "--max-new-tokens",
    "2",
    "--width",
    "2",
    "--gamma",
    "1",
    "--batch-size",
    "8",
    "--max-prompt-tokens",
    "48",
    "--ray-num-cpus",
    "2",
    "--no-progress",
]
FILLER = "The quick brown fox jumps over the lazy dog. "
# The driver, reporting its resident memory when the planning pass starts (Ray started, models
# checked, nothing of the input read yet) and its peak from then to the end of the job (the
# pass, the pipeline): Linux resets the peak on writing 5 to /proc/self/clear_refs. Ray is
# started and the job's modules imported first (as `dsbd batch` itself would, loopback only),
# so that neither counts; `dsbd batch` then uses that Ray. Ray's processes are other
# processes: not counted. It also says whether it started with SIGINT ignored.
DRIVER = """
import signal, sys
print(f"driver SIGINT ignored at start: {signal.getsignal(signal.SIGINT) is signal.SIG_IGN}")
import pyarrow.parquet, ray.data  # imported by the job anyway: not what is measured
import deployments.batch_job.job as job, deployments.batch_job.decoder, deployments.batch_job.source
from deployments.local_ray import start_local_ray, stop_local_ray
from dsbd.cli import main

def kib(key):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key))

plan_input, marks = job.plan_input, {}

def measured_plan(*args, **kwargs):
    marks["start"] = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return plan_input(*args, **kwargs)

job.plan_input = measured_plan
start_local_ray(num_cpus=2, namespace="dsbd-batch")
try:
    status = main(sys.argv[1:])
finally:
    stop_local_ray(shut_serve_down=False)
print(f"driver RSS KiB: {marks['start']} {kib('VmHWM')}", file=sys.stderr)
sys.exit(status)
"""


def write_job_input(
    root: Path, long_rows: int, long_chars: int, decoded_rows: int = 3
) -> list[Any]:
    """Four files, JSONL and Parquet in turn; returns the rows in input order (dicts, or the
    raw text of a line that is not JSON). Each file: `decoded_rows` prompts decoded, `long_rows`
    prompts of `long_chars` characters (too long), a bad knob, an unknown field (and in JSONL a
    line that is not JSON)."""
    given: list[Any] = []
    for part in range(4):
        rows: list[Any] = []
        for k in range(max(decoded_rows, long_rows)):
            if k < decoded_rows:
                rows.append(
                    {
                        "id": f"q{part}-{k}",
                        "prompt": f"one two {k} {part}",
                        "chat": False,
                        "seed": k,
                    }
                )
            if k < long_rows:
                text = f"{part}/{k} " + FILLER * (long_chars // len(FILLER))
                rows.append({"id": f"long{part}-{k}", "prompt": text, "chat": False})
        rows += [
            {"id": f"knob{part}", "prompt": "x", "width": 0},
            {"id": f"field{part}", "prompt": "x", "widht": 2},
        ]
        if part % 2:
            write_parquet(root / f"part-{part}.parquet", rows, row_group_size=16)
        else:
            rows.insert(4, "{not json")
            lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
            (root / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
        given += rows
    return given


def written_rows(out: Path) -> int:
    """Rows in the output's complete Parquet files: a file Ray Data is still writing has no
    footer yet and is not counted."""
    rows = 0
    for path in out.glob("*.parquet"):
        try:
            rows += pq.read_metadata(path).num_rows
        except Exception:
            continue
    return rows


def run_driver(
    argv: list[str],
    interrupt_when: Path | None = None,
    *,
    beyond: int = 0,
    sigint_ignored: bool = False,
) -> tuple[int, str, tuple[int, int]]:
    """`dsbd batch` in its own session; SIGINT (Ctrl-C) once the complete data files in
    `interrupt_when` hold more than `beyond` rows: this run has written records and its
    pipeline runs. `sigint_ignored`: started as a shell without job control starts a
    background command, SIGINT ignored (`trap "" INT`, then `exec`: the same process).
    Returns the exit status, stdout + stderr, and the driver's RSS in KiB when planning
    started and its peak from then on."""
    command = [sys.executable, "-c", DRIVER, "batch", *argv]
    if sigint_ignored:
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    started, sent, rows = time.monotonic(), None, 0
    try:
        while interrupt_when is not None and process.poll() is None:
            rows = written_rows(interrupt_when)
            if rows > beyond:
                process.send_signal(signal.SIGINT)
                sent = time.monotonic() - started
                break
            time.sleep(0.05)
        output, _ = process.communicate(timeout=300)
        if interrupt_when is not None:  # what a failed interrupt's message shows
            output += (
                f"\n[test] SIGINT sent {'never' if sent is None else f'{sent:.1f} s'}"
                f" after start, {rows} rows written then; the job ran"
                f" {time.monotonic() - started:.1f} s"
            )
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert not leftovers(process.pid), "dsbd batch left processes behind"
    found = [
        line.split()[-2:] for line in output.splitlines() if line.startswith("driver RSS KiB: ")
    ]
    assert found, output[-3000:]
    return process.returncode, output, (int(found[0][0]), int(found[0][1]))


def records_of(out: Path) -> list[dict[str, Any]]:
    """The records of the output's complete data files (a file cut short is not read)."""
    records = []
    for path in sorted(out.glob("*.parquet")):
        try:
            records += pq.read_table(path).to_pylist()
        except Exception:
            continue
    return records


def error_census(out: Path) -> list[tuple[tuple[str, str], int]]:
    """The output's errors by kind and message (first 200 characters), most frequent first:
    what a failing run reports of why its rows failed (the rows' own `error` column)."""
    found = Counter(
        (str(r.get("error_kind")), str(r["error"])[:200])
        for r in records_of(out)
        if r["error"] is not None
    )
    return found.most_common(6)


def check_exactly_once(records: list[dict[str, Any]], given: list[Any]) -> None:
    """One record per input row, with its id, and the right error for each bad row."""
    assert sorted(r["index"] for r in records) == list(range(len(given)))
    for record in records:
        row = given[record["index"]]
        if isinstance(row, str):
            assert record["error"].startswith("not valid JSON"), record
            continue
        assert record["id"] == row["id"]
        if row["id"].startswith("q"):
            assert record["error"] is None and len(record["token_ids"]) >= 1, record
        elif row["id"].startswith("long"):
            assert "too long; allowed: at most max_prompt_tokens=48" in record["error"]
        elif row["id"].startswith("knob"):
            assert "width=0: Input should be greater than or equal to 1" in record["error"]
        else:
            assert "widht=2: unknown field; allowed: " in record["error"], record


def test_a_directory_streams_past_the_driver_and_resumes_exactly(tmp_path: Path) -> None:
    """Driver memory flat while the input grows 10x; interrupted, resumed, every row once."""
    target, draft = build_pair(tmp_path / "models")
    flags = ["--target", str(target), "--draft", str(draft), *FLAGS]
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    given_small = write_job_input(small, long_rows=10, long_chars=150_000)
    # Rows to decode in every file of the large input: the output's files land over the whole
    # run, a burst per input file, so the first complete one lands with most of the job to do.
    given_large = write_job_input(large, long_rows=100, long_chars=150_000, decoded_rows=24)
    text_small, text_large = (
        sum(len(json.dumps(r)) for r in g) for g in (given_small, given_large)
    )
    size_small = sum(p.stat().st_size for p in small.iterdir())
    size_large = sum(p.stat().st_size for p in large.iterdir())
    assert size_large > 9 * size_small

    out = tmp_path / "small.parquet"
    status, log, rss_small = run_driver(["--input", str(small), "--output", str(out), *flags])
    assert status == 0, log[-3000:]
    check_exactly_once(records_of(out), given_small)

    out = tmp_path / "large.parquet"
    argv = ["--input", str(large), "--output", str(out), *flags]
    interrupted = "dsbd batch: interrupted; rerun the same command to resume"
    # Ctrl-C once records are on disk: the job stops (130), what it wrote stays.
    status, log, rss_cut = run_driver(argv, interrupt_when=out)
    assert "driver SIGINT ignored at start: False" in log, log[-3000:]
    assert status == 130 and interrupted in log, f"{log[-3000:]}\nerrors: {error_census(out)}"
    before = records_of(out)
    assert 0 < len(before) < len(given_large), len(before)
    # The resume, started with SIGINT ignored (`dsbd batch ... &` in a script): it skips what
    # the first run wrote, and SIGINT once it has written more stops it all the same.
    status, log, rss_cut_again = run_driver(
        argv, interrupt_when=out, beyond=len(before), sigint_ignored=True
    )
    assert "driver SIGINT ignored at start: True" in log, log[-3000:]
    assert f"{len(before)} done before" in log, log[-3000:]
    assert status == 130 and interrupted in log, f"{log[-3000:]}\nerrors: {error_census(out)}"
    between = records_of(out)
    assert len(before) < len(between) < len(given_large), (len(before), len(between))
    status, log, rss_resumed = run_driver(argv)
    assert status == 0, log[-3000:]
    summary = [line for line in log.splitlines() if line.startswith("dsbd batch: ")][-1]
    assert f"{len(between)} skipped" in summary, summary
    records = records_of(out)
    check_exactly_once(records, given_large)
    earlier = {(r["id"], r["row_hash"]) for r in between}
    assert {(r["id"], r["row_hash"]) for r in before} <= earlier
    again = [r for r in records if (r["id"], r["row_hash"]) not in earlier]
    assert len(again) == len(given_large) - len(between)  # only the rest was decoded

    # What the job added to the driver's memory (peak - RSS when planning began), for the
    # input and for the 10x input: the same, give or take noise far below the input's size.
    runs = {
        "small": rss_small,
        "interrupted": rss_cut,
        "interrupted again": rss_cut_again,
        "resumed": rss_resumed,
    }
    rise = {name: (peak - start) * 1024 for name, (start, peak) in runs.items()}
    report = (
        f"input {size_small / 1e6:.1f} -> {size_large / 1e6:.1f} MB on disk ({text_small / 1e6:.1f}"
        f" -> {text_large / 1e6:.1f} MB of row text); driver RSS when planning began "
        + " / ".join(f"{start / 1024:.0f}" for start, _ in runs.values())
        + " MiB, "
        "rise to the peak from then on: "
        + ", ".join(f"{name} {value / 2**20:.1f} MiB" for name, value in rise.items())
    )
    print(report)
    growth = max(rise["interrupted"], rise["interrupted again"], rise["resumed"]) - rise["small"]
    assert growth < 0.25 * (text_large - text_small), report  # a reader holding rows: > 1x
