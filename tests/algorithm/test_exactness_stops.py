"""Exactness with stop strings: a beam whose text holds one finishes there, and every law stays
exact (issue 52, ALGORITHM.md §12.1 items 4-5 with a stop-string rule).

The table model's tokens have texts ("", "a", "b", "ba"; token 0 is the EOS), so the stop
"aba" is spelled by three tokens ("a" "b" "a"), by two ("a" "ba") and across a boundary inside
a token ("ba" "ba"), and "bb" by two. At 1e5 sessions and 3 new tokens, a stop spans
iterations (gamma = 1), draft layers (gamma = 2, 3) and a fill token after a drafted path; the
enumeration in `exact_reference` applies the same rule with code of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer, generate_batch
from dsbd_core.algorithm.sequences.stops import ExplicitTexts, StopStrings
from tests.support.beam_search import outcomes_of
from tests.support.exact_reference import (
    TableLM,
    assert_matches,
    beam_sampling_outcomes,
    multinomial_outcomes,
    random_table,
)
from tests.support.exact_transformers import transformers_beam_outcomes

RUNS = 100_000
V = 4
EOS = 0
PROMPT = [1]
MAX_NEW = 3
TEXTS = ("", "a", "b", "ba")
STOPS = ("aba", "bb")
REFERENCE = (STOPS, TEXTS)


def tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A target bigram table (EOS rare, so stops decide) and a different draft table."""
    rng = np.random.default_rng(seed)
    target = random_table(rng, V, 2, concentration=2.0)
    target[:, EOS] = np.log(0.05)
    rest = np.log1p(-0.05)
    target[:, 1:] += rest - np.logaddexp.reduce(target[:, 1:], axis=1, keepdims=True)
    draft = random_table(rng, V, 2, concentration=1.0, zero_prob=0.2)
    return target, draft


def decode(method: str, target: np.ndarray, draft: np.ndarray | None, **config) -> list:
    cfg = SamplingConfig(
        max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), seed=config.pop("seed", 0), **config
    )
    draft_scorer = TableScorer(torch.from_numpy(draft)) if draft is not None else None
    return generate_batch(
        method,
        TableScorer(torch.from_numpy(target)),
        [PROMPT] * RUNS,
        cfg,
        draft_scorer,
        stop=StopStrings(STOPS, ExplicitTexts(TEXTS)),
    )


def exact_beam(target: np.ndarray, width: int, mode: str) -> dict:
    return beam_sampling_outcomes(
        TableLM(target), PROMPT, width, MAX_NEW, mode, {EOS}, stops=REFERENCE
    )


def _text(tokens: tuple[int, ...]) -> str:
    return "".join(TEXTS[t] for t in tokens)


def test_the_case_stops_often_and_across_tokens() -> None:
    """The enumeration's outcomes hold stops spelled by several tokens, and the decodes
    below are not dominated by EOS."""
    exact = multinomial_outcomes(TableLM(tables(1)[0]), PROMPT, MAX_NEW, {EOS}, stops=REFERENCE)
    stopped = {b: p for b, p in exact.items() if any(s in _text(b) for s in STOPS)}
    assert sum(stopped.values()) > 0.2
    assert any(len(b) == 3 and _text(b).endswith("aba") for b in stopped)  # "a" "b" "a"
    assert any(_text(b) == "baba" for b in stopped)  # across a boundary inside a token
    # a beam finishes at its first stop: no stopped beam's prefix holds one
    assert all(not any(s in _text(b[:-1]) for s in STOPS) for b in stopped)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_fixed_width_dsbd_with_stops_equals_beam_sampling(mode: str, gamma: int) -> None:
    target, draft = tables(seed=gamma)
    results = decode(
        "dsbd", target, draft, width=2, gamma=gamma, threshold=None, mode=mode, seed=gamma
    )
    exact = exact_beam(target, 2, mode)
    assert_matches(outcomes_of(results), exact, f"dsbd stops {mode} gamma={gamma}")
    assert any(sum(r.stats.accepted_layers) > 0 for r in results[:1000])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
def test_beam_sampling_with_stops_is_the_exact_sampler(mode: str) -> None:
    target, _ = tables(seed=4)
    results = decode("beam", target, None, width=3, mode=mode, seed=5)
    assert_matches(outcomes_of(results), exact_beam(target, 3, mode), f"beam stops {mode}")


@pytest.mark.slow
def test_width_one_methods_with_stops_are_multinomial_sampling() -> None:
    target, draft = tables(seed=6)
    exact = multinomial_outcomes(TableLM(target), PROMPT, MAX_NEW, {EOS}, stops=REFERENCE)
    for method, extra in (
        ("sample", {}),
        ("sps", {"gamma": 2}),
        ("dsbd", {"width": 1, "lean_memory": True, "gamma": 3}),
    ):
        results = decode(method, target, draft, seed=7, **extra)
        samples = [tuple(r.best.token_ids) for r in results]
        assert_matches(samples, exact, f"{method} {extra} stops")


@pytest.mark.slow
@pytest.mark.parametrize(("method", "extra"), [("beam", {}), ("dsbd", {"gamma": 2})])
def test_transformers_law_with_stops_is_exact(method: str, extra: dict) -> None:
    """Beam sampling under transformers' law, plain and drafted: a candidate whose text holds a
    stop is a finished hypothesis as an EOS one is (the enumeration: exact_transformers)."""
    target, draft = tables(seed=8)
    results = decode(method, target, draft, width=2, selection="transformers", seed=9, **extra)
    exact = transformers_beam_outcomes(
        TableLM(target),
        PROMPT,
        2,
        MAX_NEW,
        {EOS},
        stopped=lambda tokens: any(s in _text(tokens) for s in STOPS),
    )
    merged: dict = {}
    for key, p in exact.items():
        merged[tuple(sorted(key))] = merged.get(tuple(sorted(key)), 0.0) + p
    assert_matches(outcomes_of(results), merged, f"{method} transformers' law with stops")
