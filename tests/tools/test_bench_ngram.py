"""`dsbd bench`'s prompt-lookup methods (issue 48): `-ng` on sps, dsbd and spec-search (our
engine with `NgramDraft`) beside the model draft, and transformers' `hf-lookup`
(`prompt_lookup_num_tokens`); a run on the tiny pair with both, and `--draft ngram`."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsbd.bench.decode.harness import run_bench
from dsbd.bench.decode.methods import MethodNameError, parse_method
from dsbd.cli import main as dsbd_main
from tests.support.bench_configs import bench_config
from tests.support.tiny_models import build_pair

METHODS = [
    "dsbd-w2-g2-fixed",  # the model draft, beside the look-up
    "dsbd-w2-g2-t0.7-fk-ng",
    "dsbd-w2-g2-t0.7-ng",  # the cost model, from the look-up's own calibration
    "sps-g3-ng",
    "search-w2",
    "spec-search-w2-g2-fk-ng",
    "hf-lookup-g3",
]


def test_lookup_method_names_parse_and_canonicalise() -> None:
    dsbd = parse_method("dsbd-w3-t0.7-ng", gamma=2)
    assert (dsbd.name, dsbd.lookup, dsbd.uses_draft, dsbd.uses_draft_model) == (
        "dsbd-w3-g2-t0.7-ng",
        True,
        True,
        False,
    )
    assert parse_method("sps-fk-ng", gamma=4).name == "sps-g4-fk-ng"
    assert parse_method("spec-search-w2-ng", gamma=2).reference == "search-w2"
    hf = parse_method("hf-lookup", gamma=3)
    assert (hf.name, hf.engine, hf.uses_draft, hf.reference) == (
        "hf-lookup-g3",
        False,
        False,
        "sample",
    )
    for bad in ("beam-w2-ng", "sample-ng", "hf-assisted-ng", "hf-lookup-w2"):
        with pytest.raises(MethodNameError, match=bad):
            parse_method(bad, gamma=2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("bench-ngram-models"))


@pytest.mark.slow
def test_a_run_with_the_lookup_beside_the_model_draft(
    pair, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSBD_CALIBRATION_DIR", str(tmp_path / "calibration"))
    config = bench_config(pair, methods=METHODS, max_new_tokens=10, ngram_max=2)
    result = run_bench(config, tmp_path / "run", progress=False, say=lambda _: None)
    summary = result.summary
    assert set(METHODS) <= set(summary)
    for name in ("dsbd-w2-g2-t0.7-fk-ng", "sps-g3-ng", "spec-search-w2-g2-fk-ng"):
        assert summary[name].forward_counts_match_engine, name
    assert result.transformers_settings["prompt_lookup"] == {
        "prompt_lookup_num_tokens": [3],
        "max_matching_ngram_size": 2,
    }
    answers = {(r.prompt_id, r.method): r.answer for r in result.records}
    for prompt in {r.prompt_id for r in result.records}:  # speculative search: search's tokens
        assert answers[prompt, "spec-search-w2-g2-fk-ng"] == answers[prompt, "search-w2"]
    assert list((tmp_path / "calibration").glob("*pass-rates*.json"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ngram-max", "0"], "ngram_max"),
        (["--methods", "beam-w2-ng"], "beam takes no ['ng']"),
        (["--methods", "hf-assisted", "--draft", "ngram"], "need a draft model"),
    ],
)
def test_bad_lookup_flags_exit_2(flags, message, capsys, tmp_path) -> None:
    argv = ["bench", "--out", str(tmp_path), "--pair", "custom", "--target", "t"]
    if "--methods" not in flags:
        argv += ["--methods", "dsbd-w2-t0.7-ng"]
    assert dsbd_main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err


def test_draft_ngram_makes_every_drafting_method_draft_with_the_lookup() -> None:
    from dsbd.bench_command import build_config
    from dsbd.cli import build_parser

    argv = ["bench", "--pair", "custom", "--target", "t", "--draft", "ngram", "--ngram-max", "4"]
    argv += ["--methods", "dsbd-w3-t0.7,sps,spec-search-w2,beam-w3,hf-lookup"]
    config = build_config(build_parser().parse_args(argv))
    assert config.draft is None and config.ngram_max == 4
    assert sorted(config.methods) == [
        "beam-w3",
        "dsbd-w3-g2-t0.7-ng",
        "hf-lookup-g2",
        "sample",
        "search-w2",
        "spec-search-w2-g2-ng",
        "sps-g2-ng",
    ]
