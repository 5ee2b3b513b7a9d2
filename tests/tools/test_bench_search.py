"""`dsbd bench`'s beam-search families (issue 20): the grammar, and a run on the tiny pair where
our search, the speculative one and transformers' must return the same answers."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from dsbd.bench.decode.harness import run_bench
from dsbd.bench.decode.methods import MethodNameError, parse_method, with_references
from dsbd_core import SamplingConfig
from tests.support.bench_configs import bench_config
from tests.support.tiny_models import build_pair

METHODS = ["search-w2", "spec-search-w2-g2-fk", "hf-search-w2"]


def test_search_method_names_parse_and_canonicalise() -> None:
    plain = parse_method("search-w3", gamma=2)
    assert (plain.name, plain.engine_method(), plain.uses_draft) == (
        "search-w3",
        "beam_search",
        False,
    )
    spec = parse_method("spec-search-w3", gamma=2)
    assert (spec.name, spec.engine_method(), spec.reference) == (
        "spec-search-w3-g2",
        "spec_beam_search",
        "search-w3",
    )
    assert spec.uses_draft and spec.sampling_config(SamplingConfig()).gamma == 2
    wide = parse_method("spec-search-w3-g4-ws5-fk", gamma=2)
    assert wide.name == "spec-search-w3-g4-ws5-fk" and wide.draft_width == 5 and wide.fixed_knobs
    hf = parse_method("hf-search-w2", gamma=2)
    assert not hf.engine and hf.reference == "search-w2"
    assert [s.name for s in with_references([spec])] == ["search-w3", "spec-search-w3-g2"]
    for bad in ("search", "search-w2-t0.5", "spec-search-w2-lean", "hf-search-w2-g3"):
        with pytest.raises(MethodNameError, match=bad):
            parse_method(bad, gamma=2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("bench-search-models"))


@pytest.mark.slow
def test_the_three_searches_return_the_same_answers(pair, tmp_path) -> None:
    config = bench_config(pair, methods=METHODS, max_new_tokens=10)
    result = run_bench(config, tmp_path / "run", progress=False, say=lambda _: None)
    answers: dict[str, dict[str, str]] = defaultdict(dict)
    for record in result.records:
        answers[record.prompt_id][record.method] = record.answer
    assert len(answers) == 2
    for by_method in answers.values():
        assert len(set(by_method.values())) == 1, by_method
    summary = result.summary
    assert summary["spec-search-w2-g2-fk"].reference == "search-w2"
    assert summary["search-w2"].target_passes_per_token == pytest.approx(1.0)
    assert summary["spec-search-w2-g2-fk"].forward_counts_match_engine
