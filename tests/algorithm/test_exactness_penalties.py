"""Exactness with the per-beam processors (issue 52 item 2): min_tokens, logit_bias, the
frequency, presence and repetition penalties. Every decoder follows the penalised law exactly.

The penalised law is stated by `tests/support/exact_penalties.PenalisedLM` (code of its own,
from the fields' definitions) around the n-gram table, and enumerated by the references the other
exactness tests use: `exact_reference` for the paper's law and sampling (rows renormalised),
`exact_transformers` for transformers' law (rows as transformers' processors leave them). 1e5
sessions per decode, as in test_exactness.py. The prompt holds tokens 2 and 1, so the repetition
penalty acts from the first step; min_tokens = 1 makes the EOS impossible at the first step,
for the target and the draft alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer, generate_batch
from tests.support.beam_search import as_sets, outcomes_of
from tests.support.exact_penalties import PenalisedLM
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
PROMPT = [2, 1]
MAX_NEW = 3
FIELDS = {
    "min_tokens": 1,
    "frequency_penalty": 0.7,
    "presence_penalty": -0.4,
    "repetition_penalty": 1.6,
    "logit_bias": {3: 1.2, 1: -0.5},
}


def tables(seed: int, vocab: int = V) -> tuple[np.ndarray, np.ndarray]:
    """A target bigram table (EOS likely, so min_tokens matters) and a different draft."""
    rng = np.random.default_rng(seed)
    target = random_table(rng, vocab, 2, concentration=1.0)
    draft = random_table(rng, vocab, 2, concentration=1.0, zero_prob=0.2)
    return target, draft


def penalised(table: np.ndarray, normalise: bool = True) -> PenalisedLM:
    return PenalisedLM(
        TableLM(table),
        len(PROMPT),
        eos=(EOS,),
        min_tokens=FIELDS["min_tokens"],
        frequency=FIELDS["frequency_penalty"],
        presence=FIELDS["presence_penalty"],
        repetition=FIELDS["repetition_penalty"],
        bias=FIELDS["logit_bias"],
        normalise=normalise,
    )


def decode(method: str, target: np.ndarray, draft: np.ndarray | None, **config) -> list:
    cfg = SamplingConfig(
        max_new_tokens=MAX_NEW,
        eos_token_ids=(EOS,),
        seed=config.pop("seed", 0),
        **FIELDS,
        **config,
    )
    draft_scorer = TableScorer(torch.from_numpy(draft)) if draft is not None else None
    return generate_batch(
        method, TableScorer(torch.from_numpy(target)), [PROMPT] * RUNS, cfg, draft_scorer
    )


def test_the_penalties_change_the_law() -> None:
    """The case is not vacuous: the penalised law is far from the plain one, and no outcome
    ends before min_tokens."""
    target, _ = tables(1)
    plain = multinomial_outcomes(TableLM(target), PROMPT, MAX_NEW, {EOS})
    processed = multinomial_outcomes(penalised(target), PROMPT, MAX_NEW, {EOS})
    keys = set(plain) | set(processed)
    assert sum(abs(plain.get(k, 0.0) - processed.get(k, 0.0)) for k in keys) / 2 > 0.1
    assert plain.get((EOS,), 0.0) > 0.02 and (EOS,) not in processed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_fixed_width_dsbd_follows_penalised_beam_sampling(mode: str, gamma: int) -> None:
    target, draft = tables(seed=gamma)
    results = decode(
        "dsbd", target, draft, width=2, gamma=gamma, threshold=None, mode=mode, seed=gamma
    )
    exact = beam_sampling_outcomes(penalised(target), PROMPT, 2, MAX_NEW, mode, {EOS})
    assert_matches(outcomes_of(results), exact, f"dsbd penalised {mode} gamma={gamma}")
    assert any(sum(r.stats.accepted_layers) > 0 for r in results[:1000])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
def test_beam_sampling_follows_the_penalised_law(mode: str) -> None:
    target, _ = tables(seed=4)
    results = decode("beam", target, None, width=3, mode=mode, seed=5)
    exact = beam_sampling_outcomes(penalised(target), PROMPT, 3, MAX_NEW, mode, {EOS})
    assert_matches(outcomes_of(results), exact, f"beam penalised {mode}")


@pytest.mark.slow
def test_width_one_methods_are_penalised_sampling() -> None:
    """Sampling, SpS, DSBD at one beam in lean memory and with a dynamic width."""
    target, draft = tables(seed=6)
    exact = multinomial_outcomes(penalised(target), PROMPT, MAX_NEW, {EOS})
    for method, extra in (
        ("sample", {}),
        ("sps", {"gamma": 2}),
        ("dsbd", {"width": 1, "lean_memory": True, "gamma": 3}),
        ("dsbd", {"width": 1, "threshold": 0.6, "gamma": 2}),
    ):
        results = decode(method, target, draft, seed=7, **extra)
        samples = [tuple(r.best.token_ids) for r in results]
        assert_matches(samples, exact, f"{method} {extra} penalised")


@pytest.mark.slow
@pytest.mark.parametrize(("method", "extra"), [("beam", {}), ("dsbd", {"gamma": 2})])
def test_transformers_law_with_penalties_is_exact(method: str, extra: dict) -> None:
    """Under transformers' law the rows are not renormalised: beams accumulate the processed
    log-probs, as transformers' `_beam_search` does. Five tokens: with the EOS removed at the
    first step, four candidates are left for transformers' K = 4 draws."""
    target, draft = tables(seed=8, vocab=5)
    results = decode(method, target, draft, width=2, selection="transformers", seed=9, **extra)
    exact = transformers_beam_outcomes(
        penalised(target, normalise=False), PROMPT, 2, MAX_NEW, {EOS}
    )
    assert_matches(outcomes_of(results), as_sets(exact), f"{method} transformers' law penalised")


# min_tokens with stop strings: test_exactness_stops.py's case (tokens "", "a", "b", "ba",
# token 0 the EOS; stops "aba" and "bb") with min_tokens = 3 and 4 new tokens: a stop that ends
# at the first or second token ("a" "ba", "b" "b") is ignored and stays ignored, one ending at
# the third or fourth finishes the beam, and the EOS is impossible at the first three steps.
STOP_TEXTS = ("", "a", "b", "ba")
STOP_STRINGS = ("aba", "bb")
STOP_MIN, STOP_NEW = 3, 4


def _stop_decode(method: str, target: np.ndarray, draft: np.ndarray, **config) -> list:
    from dsbd_core.algorithm.sequences.stops import ExplicitTexts, StopStrings

    cfg = SamplingConfig(
        max_new_tokens=STOP_NEW,
        eos_token_ids=(EOS,),
        min_tokens=STOP_MIN,
        frequency_penalty=0.3,
        **config,
    )
    return generate_batch(
        method,
        TableScorer(torch.from_numpy(target)),
        [PROMPT] * RUNS,
        cfg,
        TableScorer(torch.from_numpy(draft)),
        stop=StopStrings(STOP_STRINGS, ExplicitTexts(STOP_TEXTS)),
    )


def _stop_law(target: np.ndarray) -> PenalisedLM:
    return PenalisedLM(TableLM(target), len(PROMPT), eos=(EOS,), min_tokens=STOP_MIN, frequency=0.3)


def _text(tokens: tuple[int, ...]) -> str:
    return "".join(STOP_TEXTS[t] for t in tokens)


@pytest.mark.slow
def test_min_tokens_with_stop_strings_is_exact() -> None:
    target, draft = tables(seed=11)
    stops = (STOP_STRINGS, STOP_TEXTS, STOP_MIN)
    exact = beam_sampling_outcomes(
        _stop_law(target), PROMPT, 2, STOP_NEW, "distinct", {EOS}, stops=stops
    )
    beams = {b for o in exact for b in o}
    # not vacuous: beams ran on past a stop that ended before min_tokens, and others
    # finished at one from the third token on
    assert any(len(b) == 4 and any(s in _text(b[:2]) for s in STOP_STRINGS) for b in beams)
    assert any(len(b) == 3 and any(s in _text(b) for s in STOP_STRINGS) for b in beams)
    for method, extra in (("dsbd", {"width": 2, "gamma": 2}), ("beam", {"width": 2})):
        results = _stop_decode(method, target, draft, seed=12, **extra)
        assert_matches(outcomes_of(results), exact, f"{method} min_tokens with stops")
    single = multinomial_outcomes(_stop_law(target), PROMPT, STOP_NEW, {EOS}, stops=stops)
    results = _stop_decode("sps", target, draft, seed=13, gamma=2)
    assert_matches([tuple(r.best.token_ids) for r in results], single, "sps min_tokens stops")
