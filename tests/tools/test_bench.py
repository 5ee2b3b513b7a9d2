"""`dsbd bench`: the harness end to end on tiny models, its figures' consistency, the method
grammar, the CLI's errors, and the HumanEval sandbox (passing, failing, timing-out and
network-using completions)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dsbd.bench.decode.harness import ResumeMismatchError, rebuild_report, run_bench
from dsbd.bench.decode.humaneval import (
    check_completion,
    namespaces_available,
    run_program,
    truncate_completion,
)
from dsbd.bench.decode.methods import MethodNameError, parse_method, parse_methods
from dsbd.bench.decode.quality import paired_bootstrap, ratio_bootstrap
from dsbd.bench.decode.report import compare
from dsbd.bench.decode.schema import BenchResult, MethodRecord
from dsbd.cli import main as dsbd_main
from tests.support.bench_configs import METHODS, bench_config
from tests.support.tiny_models import build_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("bench-models"))


@pytest.mark.slow
def test_harness_figures_are_consistent_and_written(pair, tmp_path):
    out = tmp_path / "run"
    result = run_bench(bench_config(pair), out, progress=False, say=lambda _: None)
    assert len(result.records) == 2 * len(METHODS)
    for name in (
        "results.json",
        "table.md",
        "records.jsonl",
        "prompts.jsonl",
        "run.json",
        "speed_quality.png",
        "accepted_length.png",
        "width_histogram.png",
    ):
        assert (out / name).stat().st_size > 0, name
    saved = BenchResult.model_validate_json((out / "results.json").read_text())
    assert saved.summary.keys() == set(METHODS)
    assert "| dsbd-w2-g2-fixed | 2 |" in (out / "table.md").read_text()
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert [p["id"] for p in prompts] == ["english-0", "code-0"] and prompts[0]["prompt_ids"]

    for record in result.records:
        stats = record.engine_stats
        if stats is not None:  # our engine: the hooks count exactly what the engine counts
            assert record.target_forward_passes == stats["target_forward_passes"]
            assert record.draft_forward_passes == stats["draft_forward_passes"]
            assert record.tokens == stats["tokens_emitted"]
            assert record.engine_loglik == pytest.approx(record.loglik, abs=1e-9)
        if record.method in ("sample", "beam-w2", "hf-sample", "hf-beam-w2"):
            assert record.draft_forward_passes == 0
        if record.method in ("sample", "beam-w2", "hf-sample"):
            assert record.target_forward_passes == record.tokens  # one forward per step
        rows = record.target_kv_peak_shape[0]
        assert record.method.endswith("-fk") or rows == (
            2 if record.method in ("beam-w2", "hf-beam-w2", "dsbd-w2-g2-fixed") else 1
        ), record.method
        assert record.target_kv_peak_bytes > 0 and record.answer_tokens <= 8
    summary = result.summary
    for name in ("sample", "beam-w2"):
        assert summary[name].time_vs_reference.value == pytest.approx(1.0)
        assert summary[name].loglik_vs_reference.value == 0.0
    assert summary["dsbd-w2-g2-fixed"].reference == "beam-w2"
    assert summary["sps-g2"].reference == summary["hf-assisted"].reference == "sample"
    assert all(s.forward_counts_match_engine for k, s in summary.items() if k[:2] != "hf")
    assert summary["dsbd-w2-g2-fixed-fk"].mean_width is not None
    assert summary["dsbd-w2-g2-fixed-fk"].target_passes_per_token < 1.0
    assert summary["sps-g2-fk"].target_passes_per_token < 1.0  # the draft is accepted at times
    assert summary["dsbd-w2-g2-t0.7-lean"].target_kv_vs_sps < 1.5
    assert summary["beam-w2"].energy_joules_per_token is None  # CPU: no energy counter
    assert "no GPU" in result.energy_note
    # any two methods compared directly (benchmarks/paired.py): the table's figures where the
    # reference is the table's; a method against itself is 1 and 0
    direct = compare(result.records, "dsbd-w2-g2-fixed", "beam-w2")
    assert direct.time_vs_reference == summary["dsbd-w2-g2-fixed"].time_vs_reference
    itself = compare(result.records, "sps-g2", "sps-g2")
    assert itself.time_vs_reference.value == pytest.approx(1.0)
    assert itself.loglik_vs_reference.value == 0.0
    with pytest.raises(ValueError, match="no-such"):
        compare(result.records, "no-such", "beam-w2")
    probe = result.transformers_assisted_with_beams
    assert probe["assistant_used"] is False and probe["assistant_forward_calls"] == 0

    # Resume: the same config measures nothing new; another config is refused.
    again = run_bench(bench_config(pair), out, progress=False, say=lambda _: None)
    assert [r.seconds for r in again.records] == [r.seconds for r in result.records]
    with pytest.raises(ResumeMismatchError, match="max_new_tokens"):
        run_bench(bench_config(pair, max_new_tokens=9), out, progress=False, say=lambda _: None)

    # Another harness's records fold into the report under their source's name.
    other = result.records[0].model_copy(update={"source": "reference", "method": "dsbd-ref"})
    rebuilt = rebuild_report(out, [other])
    assert rebuilt.summary["reference:dsbd-ref"].reference == result.records[0].reference


@pytest.mark.slow  # over a second: outside the quick loop
def test_timing_rounds_time_the_same_decodes_again_and_keep_their_median(pair, tmp_path):
    """Per-request ratios on a shared machine need more than one timing: each round decodes
    the prompt again with every method, interleaved as in the first; the tokens are the same."""
    config = bench_config(pair, methods=["beam-w2", "dsbd-w2-g2-fixed"], timing_rounds=3)
    result = run_bench(config, tmp_path / "run", progress=False, say=lambda _: None)
    assert len(result.records) == 2 * 2
    for record in result.records:
        assert record.round_seconds is not None and len(record.round_seconds) == 3
        assert record.seconds == sorted(record.round_seconds)[1]
    once = run_bench(
        bench_config(pair, methods=["beam-w2", "dsbd-w2-g2-fixed"]),
        tmp_path / "once",
        progress=False,
        say=lambda _: None,
    )
    assert [r.answer for r in once.records] == [r.answer for r in result.records]
    assert all(r.round_seconds is None for r in once.records)


@pytest.mark.slow
def test_harness_runs_humaneval_in_the_sandbox(pair, tmp_path):
    config = bench_config(pair, prompt_set="humaneval", prompts=1, methods=["sample", "beam-w2"])
    result = run_bench(config, tmp_path / "he", progress=False, say=lambda _: None)
    for record in result.records:
        assert record.prompt_id == "HumanEval/0"
        assert record.passed is False  # a 2-layer random model does not solve HumanEval
        assert record.execution.startswith(("failed", "timeout"))
        assert record.completion == truncate_completion(record.answer)
    assert result.summary["sample"].pass_at_1 == 0.0
    assert "pass@1" in (tmp_path / "he" / "table.md").read_text()


def test_method_grammar():
    assert parse_method("dsbd-w3-t0.90-wmin2", gamma=2).name == "dsbd-w3-g2-t0.9-wmin2"
    assert parse_method("dsbd-w4-g3-fixed-lean", gamma=2).name == "dsbd-w4-g3-fixed-lean"
    assert parse_method("sps", gamma=3).name == "sps-g3"
    assert parse_method("hf-beam-w4", gamma=3).reference == "beam-w4"
    assert [s.name for s in parse_methods("beam-w3, beam-w3,sample", gamma=1)] == [
        "beam-w3",
        "sample",
    ]
    for bad, message in [
        ("greedy", "unknown method"),
        ("beam", "needs a width"),
        ("dsbd-w3", "exactly one of"),
        ("sample-w3", "takes no"),
        ("dsbd-w3-t0.7-wmin4", "w_min=4 is larger than width=3"),
        ("dsbd-w3-t2", "threshold"),
    ]:
        with pytest.raises(MethodNameError, match=message):
            parse_method(bad, gamma=2)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--methods", "beam"], "--methods: method='beam'"),
        (["--prompts", "99"], "--prompts=99: allowed: 1..32"),
        (["--pair", "custom"], "--pair custom needs --target"),
    ],
)
def test_cli_rejects_bad_flags(flags, message, capsys, tmp_path):
    assert dsbd_main(["bench", "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_bootstrap_intervals():
    assert paired_bootstrap([0.0, 0.0, 0.0]) == {"n": 3, "mean": 0.0, "low": 0.0, "high": 0.0}
    wide = paired_bootstrap([-1.0, 1.0, -1.0, 1.0])
    assert wide["low"] < 0 < wide["high"]
    ratio = ratio_bootstrap([(2.0, 10), (4.0, 10)], [(1.0, 10), (2.0, 10)])
    assert ratio["ratio"] == pytest.approx(2.0) and ratio["low"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        MethodRecord.model_validate({"method": "x"})


PROBLEM = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


@pytest.mark.slow
def test_sandbox_pass_fail_timeout():
    assert check_completion(PROBLEM, "    return a + b\n").status == "passed"
    failed = check_completion(PROBLEM, "    return a - b\n")
    assert failed.status == "failed" and "AssertionError" in failed.detail
    slow = check_completion(PROBLEM, "    while True:\n        pass\n", timeout_s=1.0)
    assert slow.status == "timeout"
    cut = truncate_completion("    return a + b\n\n\ndef other():\n    pass\nprint(1)\n")
    assert cut == "    return a + b\n\n"


SANDBOXES = [
    "audit",
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(
            not namespaces_available(), reason="network namespaces (unshare) unavailable here"
        ),
    ),
]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_sandbox_blocks_network(sandbox):
    """A completion that would pass only if it reached a loopback server must fail, and the
    server must see no connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    completion = (
        "    import socket\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        "    return a + b\n"
    )
    try:
        result = check_completion(PROBLEM, completion, sandbox=sandbox)
        assert result.status == "failed", result
        assert "sandbox" in result.detail or "unreachable" in result.detail.lower()
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    spawn = run_program("import os\nos.system('true')\n", sandbox="audit")
    assert spawn.status == "failed" and "os.system" in spawn.detail
