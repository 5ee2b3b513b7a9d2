"""`dsbd batch` end to end: real CLI, real Ray Data, tiny real models in float64.

Every decoded row must equal the in-process engine's decode of that row alone with its seed
(`generate`, exact: same beams, log-likelihoods to 1e-9, same statistics), although the rows of
a batch share the models' forwards. Bad rows become error records naming the field and the
value while the others succeed; a re-run on the same output decodes only what is missing; bad
flags exit 2 before Ray starts; the CLI leaves no Ray process behind.

Ray starts twice: once inside the `dsbd batch` subprocess (its whole lifecycle, checked for
leftovers), once in this process for the in-process runs, which `dsbd batch` then uses.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from deployments.api.responses import BeamText
from dsbd.cli import main
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.methods import METHODS_WITH_DRAFT
from dsbd_core.algorithm.sequences.stops import StopStrings
from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids
from dsbd_core.models.token_bytes import LoadedTexts, token_bytes
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.serving_harness import leftovers
from tests.support.terminal import Terminal
from tests.support.tiny_models import build_pair

REPO = Path(__file__).parents[2]
DEFAULTS = {"max_new_tokens": 6, "width": 3, "gamma": 2}
# --fixed-knobs: rows are compared with `generate` in-process, which drafts `gamma` layers
# every iteration (the cost model's choices would draw other, equally exact, tokens)
FLAGS = [
    "--max-new-tokens",
    "6",
    "--width",
    "3",
    "--gamma",
    "2",
    "--dtype",
    "float64",
    "--batch-size",
    "4",
    "--max-prompt-tokens",
    "40",
    "--fixed-knobs",
]
GOOD = [
    {"id": "chat", "prompt": "What is the capital of France?", "seed": 1},
    {"prompt": "one two three", "chat": False, "seed": 2, "width": 2, "n": 2},
    {
        "id": "messages",
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "seed": 3,
        "method": "beam",
        "top_k": 5,
    },
    {"id": "ids", "prompt_ids": [5, 6, 7, 8], "seed": 4, "method": "sps", "gamma": 3},
    {"id": 17, "prompt": "Beam search keeps", "seed": 5, "threshold": "none", "n": 1},
    {"id": "sample", "prompt": "The quick brown fox", "method": "sample", "temperature": 0.7},
    {"id": "lean", "prompt": "speculative decoding", "lean_memory": True, "w_min": 2, "seed": 6},
    {
        "id": "search",
        "prompt": "one two",
        "chat": False,
        "method": "spec_beam_search",
        "width": 2,
        "n": 2,
        "logprobs": 2,
        "length_penalty": 0.5,
    },
]
BAD = {
    "bad-width": ({"prompt": "x", "width": 0}, "width=0: Input should be greater than or equal"),
    "bad-field": ({"prompt": "x", "widht": 2}, "widht=2: unknown field; allowed: "),
    "empty": ({"prompt": ""}, "prompt='': String should have at least 1 character"),
    "long": (
        {"prompt": "The quick brown fox jumps over the lazy dog. " * 3},
        "too long; allowed: at most max_prompt_tokens=40",
    ),
    "bad-n": ({"prompt": "x", "n": 4}, "n=4 is larger than width=3"),
    "bad-stop": (
        {"prompt": "x", "stop": ["a", ""]},
        "stop=['a', '']: stop[1]='' is empty; allowed: strings of 1..256",
    ),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Any]:
    """Tiny target + draft on disk, loaded in float64 for the in-process reference."""
    target_dir, draft_dir = build_pair(tmp_path_factory.mktemp("models"))
    target = load_causal_lm(str(target_dir), dtype=torch.float64)
    draft = load_causal_lm(str(draft_dir), dtype=torch.float64)
    flags = ["--target", str(target_dir), "--draft", str(draft_dir), *FLAGS]
    return {"target": target, "draft": draft, "flags": flags}


def rows() -> list[dict[str, Any]]:
    """GOOD and BAD rows interleaved (so bad rows share batches with good ones)."""
    bad = [{"id": name, **row} for name, (row, _) in BAD.items()]
    out = []
    for i, row in enumerate(GOOD):
        out.append(row)
        if i < len(bad):
            out.append(bad[i])
    return out


def stops(target: Any, row: dict[str, Any]) -> StopStrings | None:
    """A row's stop strings as the engine matches them (None: the row has none)."""
    if not row.get("stop"):
        return None
    return StopStrings(tuple(row["stop"]), LoadedTexts(token_bytes(target.tokenizer)))


def stop_row(pair: dict[str, Any]) -> dict[str, Any]:
    """A row whose stop string (two tokens from the middle of its decode without it) ends its
    best beam midway: the tiny models' weights are random, so the stop is found, not known."""
    row = {"id": "stop", "prompt": "one two three", "chat": False, "seed": 7, "method": "beam"}
    free = expected(pair, row, 7)[1].best.token_ids
    texts = BeamText(pair["target"].tokenizer)
    for i in range(1, len(free) - 2):
        candidate = {**row, "stop": [texts.decode(free[i : i + 2])]}
        if candidate["stop"][0].strip():
            best = expected(pair, candidate, 7)[1].best
            if texts.with_stops(candidate["stop"], False).stop_reason(best):
                return candidate
    raise AssertionError(f"no two tokens of {free} make a stop that ends the best beam")


def expected(pair: dict[str, Any], row: dict[str, Any], seed: int) -> Any:
    """The in-process decode of one row alone with its seed (and its stop strings): what its
    record must hold."""
    target = pair["target"]
    knobs = {k: v for k, v in row.items() if k in SamplingConfig.model_fields}
    if knobs.get("threshold") == "none":
        knobs["threshold"] = None
    config = SamplingConfig(
        **{**DEFAULTS, **knobs, "seed": seed}, eos_token_ids=stop_token_ids(target)
    )
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
    elif "messages" in row:
        text = target.tokenizer.apply_chat_template(
            row["messages"], tokenize=False, add_generation_prompt=True
        )
        ids = target.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = encode_prompt(target, row["prompt"], chat=row.get("chat"))
    method = row.get("method", "dsbd")
    draft = TransformerScorer(pair["draft"].model) if method in METHODS_WITH_DRAFT else None
    scorer = TransformerScorer(target.model)
    result = generate(method, scorer, ids, config, draft=draft, stop=stops(target, row))
    return ids, result


def check_records(
    pair: dict[str, Any], records: list[dict[str, Any]], given: list, fixed: frozenset = frozenset()
) -> None:
    """One record per row: decoded rows exactly as alone in-process, bad rows as errors."""
    assert sorted(r["index"] for r in records) == list(range(len(given)))
    by_index = {r["index"]: r for r in records}
    for index, row in enumerate(given):
        record = by_index[index]
        name = row.get("id")
        if name in BAD and name not in fixed:
            assert record["id"] == name and record["text"] is None, record
            assert BAD[name][1] in record["error"], record["error"]
            assert record["error_kind"] == "invalid_row"
            continue
        assert record["error"] is None, record["error"]
        assert record["id"] == (str(name) if name is not None else record["id"])
        if name is None:  # derived: row<index>-<SHA-256 of the canonical JSON, 12 hex digits>
            canonical = json.dumps(row, sort_keys=True, separators=(",", ":")).encode()
            assert record["id"] == f"row{index}-{hashlib.sha256(canonical).hexdigest()[:12]}"
        ids, want = expected(pair, row, record["seed"])
        n = row.get("n", len(want.beams))
        assert record["prompt_tokens"] == len(ids)
        assert [b["token_ids"] for b in record["beams"]] == [b.token_ids for b in want.beams[:n]]
        for got, beam in zip(record["beams"], want.beams, strict=False):
            assert abs(got["log_likelihood"] - beam.log_likelihood) < 1e-9
            assert got["finished"] == beam.finished
            if beam.token_logprobs is None:
                assert got["token_logprobs"] is None and got["top_logprobs"] is None
                continue
            assert got["token_logprobs"] == pytest.approx(beam.token_logprobs, abs=1e-9)
            tops = [[t["token_id"] for t in top] for top in got["top_logprobs"]]
            assert tops == [[t for t, _ in top] for top in beam.top_logprobs]
        assert record["token_ids"] == want.best.token_ids
        assert record["finish_reason"] == ("stop" if want.best.finished else "length")
        view = BeamText(pair["target"].tokenizer).with_stops(row.get("stop") or [], False)
        assert record["text"] == view.text(want.best)
        assert record["stop_reason"] == view.stop_reason(want.best)
        assert [b["stop_reason"] for b in record["beams"]] == [
            view.stop_reason(b) for b in want.beams[:n]
        ]
        if row.get("stop"):  # the stop string ended the best beam: its text is cut before it
            assert record["stop_reason"] == row["stop"][0]
            assert row["stop"][0] not in record["text"], record["text"]
        assert record["method"] == row.get("method", "dsbd")
        if "seed" in row:
            assert record["seed"] == row["seed"]
        stats = dict(record["stats"])
        assert stats.pop("seconds") > 0 and stats.pop("batch_rows") >= 1
        assert stats == want.stats.as_dict()


def test_lockstep_requests_decode_as_alone_and_fail_alone(pair) -> None:
    """dsbd_core.algorithm.drivers.lockstep without Ray: own method, knobs and seed per request,
    shared
    forwards."""
    from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
    from dsbd_core.algorithm.drivers.session_batch import SessionBatcher

    target, draft = pair["target"], pair["draft"]
    eos = stop_token_ids(target)
    cases = [
        ("dsbd", [5, 6, 7], {"width": 3, "gamma": 2, "seed": 1}),
        ("beam", [8, 9], {"width": 2, "seed": 2}),
        ("sps", [10], {"gamma": 3, "seed": 3}),
        ("dsbd", [], {"seed": 4}),  # empty prompt: fails alone
        ("sample", [11, 12, 13, 14], {"temperature": 0.5, "seed": 5}),
        ("dsbd", [1, 2], {"width": 2, "threshold": None, "lean_memory": False, "seed": 6}),
    ]
    requests = [
        Request(ids, SamplingConfig(max_new_tokens=7, eos_token_ids=eos, **knobs), method)
        for method, ids, knobs in cases
    ]
    # and a request with a stop string that ends its best beam midway (issue 52)
    row = stop_row(pair)
    knobs = {"max_new_tokens": 6, "width": 3, "seed": 7}
    config = SamplingConfig(eos_token_ids=eos, **knobs)
    prompt = encode_prompt(target, row["prompt"], chat=False)
    requests.append(Request(prompt, config, "beam", stop=stops(target, row)))
    target_batcher = SessionBatcher(TransformerScorer(target.model))
    draft_batcher = SessionBatcher(TransformerScorer(draft.model))
    results, report = decode_lockstep(requests, target_batcher, draft_batcher)
    assert "empty prompt" in str(results[3].error) and results[3].result is None
    for request, got in zip(requests, results, strict=True):
        if not request.prompt_ids:
            continue
        assert got.error is None and got.seed == request.config.seed
        alone = TransformerScorer(draft.model) if request.method in METHODS_WITH_DRAFT else None
        want = generate(
            request.method,
            TransformerScorer(target.model),
            request.prompt_ids,
            request.config,
            alone,
            stop=request.stop,
        )
        assert [b.token_ids for b in got.result.beams] == [b.token_ids for b in want.beams]
        assert got.result.stats.as_dict() == want.stats.as_dict()
    # one target forward per iteration for all live requests, and no cache left behind
    assert report.target_forwards == report.iterations
    assert target_batcher.cached == [] and draft_batcher.cached == []


def read_jsonl(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for p in sorted(directory.glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]


def test_jsonl_job_through_the_cli_decodes_every_row_as_alone(pair, tmp_path: Path) -> None:
    """The real command in its own session: Ray started and stopped by it, nothing left; a
    row's stop string ends its beam as in-process, and a bad one is an error naming `stop`."""
    given = [*rows(), stop_row(pair)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in given) + "\n")
    out = tmp_path / "out.jsonl"
    command = [str(REPO / ".venv/bin/dsbd")]
    if not Path(command[0]).exists():
        command = [sys.executable, "-m", "dsbd"]
    command += [
        "batch",
        "--input",
        str(source),
        "--output",
        str(out),
        "--ray-num-cpus",
        "2",
        *pair["flags"],
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    stdout, stderr = process.communicate(timeout=300)
    assert not leftovers(process.pid), "dsbd batch left processes behind"
    assert process.returncode == 0, stderr[-3000:]
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith(
        f"dsbd batch: {len(GOOD) + 1} rows decoded, {len(BAD)} failed, 0 skipped"
    ), summary
    check_records(pair, read_jsonl(out), given)


@pytest.fixture(scope="module")
def ray_here():
    """A local Ray in this process (the in-process `dsbd batch` runs use it)."""
    from deployments.local_ray import start_local_ray, stop_local_ray

    start_local_ray(num_cpus=2, namespace="test-batch")
    yield
    stop_local_ray()


def test_parquet_job_then_resume_decodes_only_what_is_missing(
    pair, ray_here, tmp_path: Path, capsys
) -> None:
    given = [r for r in rows() if r.get("id") not in ("bad-field", "long")]
    given = [{**r, "id": str(r["id"])} if "id" in r else r for r in given]
    for r in given:  # Parquet columns have one type: thresholds as numbers (null = default)
        if r.get("threshold") == "none":
            r.pop("threshold")
    source = tmp_path / "prompts.parquet"
    names = sorted({k for r in given for k in r})
    pq.write_table(pa.table({k: [r.get(k) for r in given] for k in names}), source)
    out = tmp_path / "out.parquet"
    command = ["batch", "--input", str(source), "--output", str(out), *pair["flags"]]
    assert main(command) == 0
    first = sorted(out.glob("*.parquet"))
    records = pq.read_table(out).to_pylist()  # the directory reads as one dataset
    check_records(pair, records, given)
    assert len(first) >= 3, first  # one file per block of --batch-size rows

    # Interrupted before its last file was written, a file cut short, and a bad row fixed
    # (same id, new content): these rows are decoded again; invalid rows are final.
    gone = {r["id"] for r in pq.read_table(first[-1]).to_pylist()}
    first[-1].unlink()
    cut = {r["id"] for r in pq.read_table(first[0]).to_pylist()}
    first[0].write_bytes(first[0].read_bytes()[:100])
    for r in given:
        if r.get("id") == "bad-width":
            r["width"] = 2
    pq.write_table(pa.table({k: [r.get(k) for r in given] for k in names}), source)
    capsys.readouterr()
    assert main(command) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    redone = gone | cut | {"bad-width"}
    assert f"{len(given) - len(redone)} skipped" in summary, summary
    new = sorted(set(out.glob("*.parquet")) - set(first))
    written = [r for p in new for r in pq.read_table(p).to_pylist()]
    # No decoding for done rows: the new files hold the redone ids only, and the rows decoded
    # together were only those (batch_rows counts the rows of a shared decode).
    assert sorted(r["id"] for r in written) == sorted(redone)
    assert all(r["stats"]["batch_rows"] <= len(redone) for r in written if r["stats"])
    assert (out / "_incomplete" / first[0].name).exists()  # the cut file, moved aside
    records = pq.read_table(out).to_pylist()
    check_records(pair, records, given, fixed=frozenset({"bad-width"}))  # one record per row

    assert main(command) == 0  # all done: nothing decoded, Ray not even needed
    assert f"0 rows decoded, 0 failed, {len(given)} skipped" in capsys.readouterr().out


def test_progress_bar_on_a_terminal_and_none_with_no_progress(
    pair, ray_here, tmp_path: Path, monkeypatch
) -> None:
    """The same one-row job twice on a terminal: Ray Data's bars on stderr, then none."""
    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps({"prompt": "one two three", "chat": False, "seed": 2}) + "\n")
    shown = {}
    for flags in ([], ["--no-progress"]):
        out, stdout, stderr = tmp_path / f"out{len(flags)}.jsonl", Terminal(), Terminal()
        with monkeypatch.context() as patch:
            patch.setattr(sys, "stdout", stdout.file)
            patch.setattr(sys, "stderr", stderr.file)
            status = main(
                ["batch", "--input", str(source), "--output", str(out), *pair["flags"], *flags]
            )
        shown[bool(flags)] = stdout.text(), stderr.text()
        assert status == 0, shown[bool(flags)]
        assert len(read_jsonl(out)) == 1
    bar = re.compile(r"MapBatches\(BatchDecoder\)\s+\d+%\s*━")  # operator, percent, bar
    for quiet, (stdout, stderr) in shown.items():
        assert "dsbd batch: 1 rows decoded, 0 failed, 0 skipped" in stdout, stdout
        assert not bar.search(stdout), "a progress bar on stdout"
        if quiet:
            assert not bar.search(stderr) and "━" not in stderr, stderr[-2000:]
        else:
            assert re.search(r"MapBatches\(BatchDecoder\)\s+100%\s*━", stderr), stderr[-2000:]
            assert re.search(r"Write\s+100%\s*━", stderr), stderr[-2000:]


def test_resume_retries_decode_failures_and_edited_rows_only(tmp_path: Path) -> None:
    """Which rows a re-run decodes, from records alone: no Ray, no model."""
    from deployments.batch_job.output import OUTPUT_SCHEMA, OutputDir

    out = OutputDir(str(tmp_path / "out.jsonl"), "jsonl")
    (tmp_path / "out.jsonl").mkdir()
    old = [
        {"id": "ok", "row_hash": "h1", "index": 0, "stats": {"tokens_emitted": 3}},
        {
            "id": "flaky",
            "row_hash": "h2",
            "index": 1,
            "error": "decoding failed: OOM",
            "error_kind": "decode_failed",
        },
        {"id": "edited", "row_hash": "h3-old", "index": 2, "stats": {"tokens_emitted": 1}},
        {
            "id": "invalid",
            "row_hash": "h4",
            "index": 3,
            "error": "width=0: ...",
            "error_kind": "invalid_row",
        },
        {"id": "other-input", "row_hash": "h5", "index": 0, "stats": {"tokens_emitted": 2}},
    ]
    table = pa.Table.from_pylist(old, schema=OUTPUT_SCHEMA)
    (tmp_path / "out.jsonl" / "run1_x_000000.jsonl").write_bytes(out.encode(table))
    keys = [("ok", "h1"), ("flaky", "h2"), ("edited", "h3-new"), ("invalid", "h4"), ("new", "h6")]
    state = out.scan()
    pending = state.pending(keys)
    assert [keys[i][0] for i in pending] == ["flaky", "edited", "new"]
    redo = {keys[i][0] for i in pending}
    assert out.drop_stale(state.files, redo, state.final & set(keys)) == 2
    kept = sorted(r["id"] for r in out.read(out.data_files()[0]))
    assert kept == ["invalid", "ok", "other-input"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--input", "missing.jsonl"], "--input 'missing.jsonl': no such file"),
        (["--input", "prompts.csv"], "--input 'prompts.csv': unknown suffix; allowed: .jsonl"),
        (["--output", "out.csv"], "--output 'out.csv': unknown suffix '.csv'"),
        (["--width", "0"], "--width=0: Input should be greater than or equal to 1"),
        (["--n", "5"], "--n: n=5 is larger than width=3"),
        (["--batch-size", "0"], "--batch-size=0: Input should be greater than or equal to 1"),
        (["--target", "no-such-model"], "--target 'no-such-model':"),
        (["--format", "jsonl"], "--format jsonl contradicts --output"),
    ],
)
def test_bad_flags_exit_2_before_ray_starts(
    pair, flags: list[str], message: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    import deployments.batch_job.job

    def no_ray(*_: Any) -> None:
        raise AssertionError("Ray was started for a command line that is invalid")

    monkeypatch.setattr(deployments.batch_job.job, "_start_ray", no_ray)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    switches = [f for f in pair["flags"] if f == "--fixed-knobs"]  # a flag without a value
    valued = [f for f in pair["flags"] if f not in switches]
    given = dict(zip(valued[::2], valued[1::2], strict=True))
    given |= {"--input": "prompts.jsonl", "--output": "out.parquet"}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        given[flag] = value
    argv = ["batch", *[x for item in given.items() for x in item], *switches]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.parquet").exists()


def test_output_of_other_settings_or_not_ours_is_refused(pair, tmp_path: Path, capsys) -> None:
    """Resuming with other settings would mix two configurations' results: refused."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    argv = ["batch", "--input", str(empty), *pair["flags"]]
    assert main([*argv, "--output", str(foreign), "--overwrite"]) == 2
    assert "no dsbd batch wrote" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "precious"
    done = tmp_path / "done.jsonl"
    assert main([*argv, "--output", str(done)]) == 0  # no rows: settings recorded, no Ray
    assert "0 rows decoded, 0 failed, 0 skipped" in capsys.readouterr().out
    assert main([*argv, "--output", str(done), "--width", "2"]) == 2
    err = capsys.readouterr().err
    assert "was written with defaults.config.width=3, this run asks defaults.config.width=2" in err
    assert main([*argv, "--output", str(done), "--format", "parquet"]) == 2
    assert "--format parquet contradicts --output" in capsys.readouterr().err
    assert main([*argv, "--output", str(done), "--width", "2", "--overwrite"]) == 0
