"""Tests of the exact reference itself (``tests/support/exact_reference.py``).

Why: every statistical exactness test of the engine trusts this reference, so it must be
checked independently — by hand-computed small cases, by an identity (W = 1 is ordinary
sampling), by a direct Monte-Carlo simulation of the process written here, and by showing that
the harness *rejects* deliberately wrong samplers (otherwise passing tests would mean nothing).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest

from tests.support.exact_reference import (
    MODES,
    TableLM,
    assert_matches,
    beam_sampling_outcomes,
    best_answer,
    best_answer_distribution,
    candidate_distribution,
    empirical,
    joint_filter,
    multinomial_outcomes,
    null_tv_quantile,
    random_table,
    tv,
)

EOS = 3
# Filtering used by the Monte-Carlo tests: every knob active, none degenerate.
FILTER = dict(temperature=0.8, top_k=6, top_p=0.95)


def bigram(rows: list[list[float]]) -> TableLM:
    """A bigram model from explicit probabilities (zeros allowed)."""
    with np.errstate(divide="ignore"):
        return TableLM(np.log(np.array(rows, dtype=np.float64)))


def assert_distributions_close(p: dict, q: dict, atol: float = 1e-12) -> None:
    for key in set(p) | set(q):
        assert p.get(key, 0.0) == pytest.approx(q.get(key, 0.0), abs=atol), key


# --------------------------------------------------------------------------------------------
# Toy models and filtering
# --------------------------------------------------------------------------------------------


def test_table_lm_uses_last_order_minus_one_tokens() -> None:
    table = random_table(np.random.default_rng(0), 4, 3, 1.0)
    lm = TableLM(table)
    assert lm.order == 3 and lm.vocab_size == 4
    np.testing.assert_array_equal(lm.next_logprobs((2, 0, 1, 3)), table[1, 3])
    np.testing.assert_array_equal(lm.next_logprobs((1, 3)), table[1, 3])
    with pytest.raises(ValueError):
        lm.next_logprobs((1,))
    expected = table[0, 1, 2] + table[1, 2, 3]
    assert lm.sequence_logprob((0, 1), (2, 3)) == pytest.approx(expected)


def test_random_table_rows_are_normalised_and_can_have_exact_zeros() -> None:
    table = random_table(np.random.default_rng(1), 5, 3, 0.5, zero_prob=0.4)
    assert table.shape == (5, 5, 5)
    np.testing.assert_allclose(np.exp(table).sum(axis=-1), 1.0)
    assert np.isneginf(table).any(), "zero_prob should create -inf entries"
    assert np.isfinite(table).any(axis=-1).all(), "every context keeps some mass"
    assert not np.isneginf(random_table(np.random.default_rng(1), 5, 2, 0.5)).any()


def test_joint_filter_temperature_only() -> None:
    x = np.log([0.5, 0.25, 0.25])
    np.testing.assert_allclose(joint_filter(x, 1.0, 0, 1.0), [0.5, 0.25, 0.25])
    # p**(1/T) with T = 0.5: [0.25, 0.0625, 0.0625] normalised.
    np.testing.assert_allclose(joint_filter(x, 0.5, 0, 1.0), [2 / 3, 1 / 6, 1 / 6])


def test_joint_filter_excludes_minus_inf_and_is_shift_invariant() -> None:
    x = np.array([0.3, -np.inf, -1.2, 0.9, -0.4])
    for args in [(1.0, 0, 1.0), (0.6, 3, 1.0), (1.3, 0, 0.8), (0.8, 2, 0.9)]:
        probs = joint_filter(x, *args)
        assert probs[1] == 0.0
        assert probs.sum() == pytest.approx(1.0)
        np.testing.assert_allclose(joint_filter(x + 7.5, *args), probs, atol=1e-12)


def test_joint_filter_top_k_keeps_ties_with_kth_value() -> None:
    x = np.array([1.0, 3.0, 3.0, 0.0])
    np.testing.assert_allclose(joint_filter(x, 1.0, 1, 1.0), [0, 0.5, 0.5, 0])
    np.testing.assert_allclose(joint_filter(np.array([-np.inf, 1, 2, 3.0]), 1.0, 2, 1.0)[:2], 0)
    # k >= number of finite entries keeps everything.
    y = np.array([-np.inf, 0.0, 1.0])
    np.testing.assert_allclose(joint_filter(y, 1.0, 2, 1.0), joint_filter(y, 1.0, 0, 1.0))


def test_joint_filter_top_p_keeps_the_crossing_entry() -> None:
    x = np.log([0.05, 0.5, 0.15, 0.3])
    np.testing.assert_allclose(joint_filter(x, 1.0, 0, 0.7), [0, 0.625, 0, 0.375])
    np.testing.assert_allclose(
        joint_filter(x, 1.0, 0, 0.85), [0, 0.5, 0.15, 0.3] / np.float64(0.95)
    )
    np.testing.assert_allclose(joint_filter(x, 1.0, 0, 0.4), [0, 1, 0, 0])


def test_joint_filter_top_p_breaks_ties_by_index() -> None:
    x = np.array([0.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(joint_filter(x, 1.0, 0, 0.3), [0, 1, 0, 0])
    np.testing.assert_allclose(joint_filter(np.zeros(4), 1.0, 0, 0.4), [0.5, 0.5, 0, 0])


def test_joint_filter_top_p_uses_mass_after_top_k() -> None:
    # After top-k=2 the kept masses are 0.5/0.8 and 0.3/0.8; top-p 0.6 then keeps only one.
    x = np.log([0.5, 0.3, 0.2])
    np.testing.assert_allclose(joint_filter(x, 1.0, 2, 0.6), [1, 0, 0])


# --------------------------------------------------------------------------------------------
# Exact beam-sampling enumeration
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("order", "width", "filt", "eos"),
    [
        (2, 3, dict(), ()),
        (2, 3, dict(), (EOS,)),
        (3, 2, FILTER, (EOS,)),
        (3, 3, dict(temperature=1.4, top_k=0, top_p=0.8), (EOS, 0)),
    ],
)
def test_outcome_probabilities_sum_to_one(mode, order, width, filt, eos) -> None:
    lm = TableLM(random_table(np.random.default_rng(order), 4, order, 1.0, zero_prob=0.2))
    prompt = tuple(range(order - 1))
    outcomes = beam_sampling_outcomes(lm, prompt, width, 3, mode, eos, **filt)
    assert math.fsum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(p > 0 for p in outcomes.values())
    for outcome in outcomes:
        assert list(outcome) == sorted(outcome)
        finished = [b for b in outcome if b[-1] in eos]
        assert all(t not in eos for b in outcome for t in b[:-1]), "nothing after EOS"
        assert all(len(b) == 3 for b in outcome if b[-1] not in eos), "active beams run to N"
        if mode == "with_replacement":
            assert len(outcome) == width, "finished + active beams always fill the width"
        else:
            assert len(set(outcome)) == len(outcome) <= width
        assert len(finished) <= width
    answers = best_answer_distribution(outcomes, lm, prompt)
    assert math.fsum(answers.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "filt", [dict(), FILTER, dict(temperature=1.5, top_k=2, top_p=1.0), dict(top_p=0.75)]
)
def test_width_one_equals_multinomial_sampling(mode, filt) -> None:
    lm = TableLM(random_table(np.random.default_rng(5), 5, 3, 0.8, zero_prob=0.3))
    beams = beam_sampling_outcomes(lm, (4, 1), 1, 4, mode, (EOS,), **filt)
    plain = multinomial_outcomes(lm, (4, 1), 4, (EOS,), **filt)
    assert all(len(outcome) == 1 for outcome in beams)
    assert_distributions_close({outcome[0]: p for outcome, p in beams.items()}, plain)


def test_one_step_with_replacement_is_iid_sequence_probabilities() -> None:
    lm = bigram([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.1, 0.1, 0.8]])
    p = [0.6, 0.1, 0.3]  # row of the prompt's last token 1
    outcomes = beam_sampling_outcomes(lm, (0, 1), 2, 1, "with_replacement")
    expected = {}
    for a, b in itertools.combinations_with_replacement(range(3), 2):
        expected[((a,), (b,))] = p[a] * p[b] * (1 if a == b else 2)
    assert_distributions_close(outcomes, expected)


def test_two_steps_with_replacement_follow_normalised_sequence_probabilities() -> None:
    """Hand recomputation: step 2 draws i.i.d. from p(beam) p(v | beam) / sum, per beam row."""
    rows = [[0.7, 0.3], [0.4, 0.6]]
    lm = bigram(rows)
    expected: dict = defaultdict(float)
    for first in itertools.product(range(2), repeat=2):
        p_first = rows[0][first[0]] * rows[0][first[1]]
        # Duplicate parent rows are separate candidates with the same weight.
        weights = [rows[0][a] * rows[a][v] for a in first for v in range(2)]
        cands = [(a, v) for a in first for v in range(2)]
        total = sum(weights)
        for i, j in itertools.product(range(4), repeat=2):
            outcome = tuple(sorted([cands[i], cands[j]]))
            expected[outcome] += p_first * weights[i] * weights[j] / total**2
    outcomes = beam_sampling_outcomes(lm, (0,), 2, 2, "with_replacement")
    assert_distributions_close(outcomes, dict(expected))


def test_candidate_distribution_without_filtering_is_sequence_probability() -> None:
    lm = TableLM(random_table(np.random.default_rng(3), 4, 2, 1.0))
    beams = [(0, 2), (1, 1), (3, 0)]
    table = candidate_distribution(lm, (2,), beams)
    seq = np.array(
        [[math.exp(lm.sequence_logprob((2,), b + (v,))) for v in range(4)] for b in beams]
    )
    np.testing.assert_allclose(table, seq / seq.sum())


def test_one_step_distinct_is_sequential_without_replacement() -> None:
    lm = bigram([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]])
    p = [0.5, 0.3, 0.2]
    outcomes = beam_sampling_outcomes(lm, (0,), 2, 1, "distinct")
    expected = {
        ((a,), (b,)): p[a] * p[b] / (1 - p[a]) + p[b] * p[a] / (1 - p[b])
        for a, b in itertools.combinations(range(3), 2)
    }
    assert_distributions_close(outcomes, expected)


def test_distinct_takes_every_candidate_with_mass_when_fewer_than_width() -> None:
    lm = bigram([[0.5, 0.5, 0.0, 0.0]] + [[0.25] * 4] * 3)
    assert beam_sampling_outcomes(lm, (0,), 3, 1, "distinct") == pytest.approx({((0,), (1,)): 1.0})
    # Joint top-k = 2 (no ties in a random table) leaves 2 candidates per step for width 3.
    lm2 = TableLM(random_table(np.random.default_rng(2), 4, 2, 1.0))
    outcomes = beam_sampling_outcomes(lm2, (1,), 3, 2, "distinct", top_k=2)
    assert all(len(o) == 2 for o in outcomes)


def test_finished_beams_shrink_the_width_of_later_steps() -> None:
    # Token 1 is EOS and has probability 1/2 from the start token 0; after 0 the row is uniform.
    lm = bigram([[0.5, 0.5], [0.5, 0.5]])
    outcomes = beam_sampling_outcomes(lm, (0,), 2, 2, "with_replacement", eos={1})
    # Both first draws EOS (1/4): no second step. One EOS (1/2): the other beam draws once.
    assert outcomes[((1,), (1,))] == pytest.approx(0.25)
    assert outcomes[((0, 0), (1,))] == pytest.approx(0.25)
    assert outcomes[((0, 1), (1,))] == pytest.approx(0.25)
    assert sum(p for o, p in outcomes.items() if (1,) not in o) == pytest.approx(0.25)


def test_best_answer_uses_length_normalised_true_scores_and_tie_break() -> None:
    lm = bigram([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.5, 0.25, 0.25]])
    # (0, 1): (log .5 + log .25) / 2 = 1.5 log .5 beats (1,): log .25 = 2 log .5.
    assert best_answer([(1,), (0, 1)], lm, (0,)) == (0, 1)
    # Without length normalisation the shorter beam wins.
    assert best_answer([(1,), (0, 1)], lm, (0,), length_penalty=0.0) == (1,)
    # Exact tie: (1,) and (2,) have the same score -> smaller tuple.
    assert best_answer([(2,), (1,)], lm, (0,)) == (1,)


# --------------------------------------------------------------------------------------------
# Statistics helpers
# --------------------------------------------------------------------------------------------


def test_empirical_and_tv() -> None:
    assert empirical(["a", "b", "a", "a"]) == {"a": 0.75, "b": 0.25}
    assert tv({"a": 1.0}, {"b": 1.0}) == 1.0
    assert tv({"a": 0.5, "b": 0.5}, {"a": 0.25, "b": 0.75}) == pytest.approx(0.25)


def test_null_quantile_is_deterministic_and_shrinks_with_n() -> None:
    exact = {k: p for k, p in enumerate(np.random.default_rng(0).dirichlet(np.ones(50)))}
    small, large = null_tv_quantile(exact, 10_000), null_tv_quantile(exact, 100_000)
    assert small == null_tv_quantile(exact, 10_000)
    assert large < small
    # TV noise scales like 1/sqrt(n).
    assert small / large == pytest.approx(math.sqrt(10), rel=0.25)


def test_assert_matches_accepts_exact_samples_and_rejects_impossible_ones() -> None:
    exact = {"a": 0.5, "b": 0.3, "c": 0.2}
    rng = np.random.default_rng(0)
    samples = list(rng.choice(["a", "b", "c"], size=5000, p=[0.5, 0.3, 0.2]))
    distance, threshold = assert_matches(samples, exact, "exact draws")
    assert distance <= threshold
    with pytest.raises(AssertionError, match="zero exact probability"):
        assert_matches([*samples, "z"], exact, "impossible")
    with pytest.raises(AssertionError, match="TV"):
        assert_matches(list(rng.choice(["a", "b", "c"], size=5000)), exact, "uniform")


# --------------------------------------------------------------------------------------------
# Monte-Carlo check of the enumerator, and power of the harness
# --------------------------------------------------------------------------------------------


class BeamSamplingSimulator:
    """Direct simulation of target beam sampling, one run per call, independent of the
    enumerator (it only shares the model and ``joint_filter``, both tested above).

    ``force_replacement`` and ``ignore_temperature`` inject the two deliberate bugs used to
    show that ``assert_matches`` has power. Filtered tables are memoised per (ordered) beam
    list to keep 2e4 runs fast; the random draws are fresh every time.
    """

    def __init__(
        self,
        lm,
        prompt,
        width,
        n_steps,
        mode,
        eos,
        temperature,
        top_k,
        top_p,
        *,
        force_replacement=False,
        ignore_temperature=False,
    ) -> None:
        self.lm, self.prompt, self.width, self.n_steps = lm, tuple(prompt), width, n_steps
        self.replace = mode == "with_replacement" or force_replacement
        self.eos = set(eos)
        self.filter = (1.0 if ignore_temperature else temperature, top_k, top_p)
        self._tables: dict = {}

    def _probs(self, beams: tuple, scores: tuple) -> np.ndarray:
        if beams not in self._tables:
            rows = [
                s + self.lm.next_logprobs(self.prompt + b)
                for b, s in zip(beams, scores, strict=True)
            ]
            self._tables[beams] = joint_filter(np.concatenate(rows), *self.filter)
        return self._tables[beams]

    @staticmethod
    def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
        cumulative = np.cumsum(weights)
        index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        return min(index, int(np.flatnonzero(weights)[-1]))

    def run(self, rng: np.random.Generator) -> tuple:
        vocab = self.lm.vocab_size
        beams, scores = ((),), (0.0,)
        finished: list = []
        remaining = self.width
        for _ in range(self.n_steps):
            if not beams:
                break
            probs = self._probs(beams, scores)
            if self.replace:
                picks = [self._draw(probs, rng) for _ in range(remaining)]
            else:
                weights = probs.copy()
                picks = []
                for _ in range(min(remaining, np.count_nonzero(weights))):
                    picks.append(self._draw(weights, rng))
                    weights[picks[-1]] = 0.0
            new_beams, new_scores = [], []
            for k in picks:
                parent, token = divmod(k, vocab)
                beam = beams[parent] + (token,)
                score = scores[parent] + self.lm.next_logprobs(self.prompt + beams[parent])[token]
                if token in self.eos:
                    finished.append(beam)
                    remaining -= 1
                else:
                    new_beams.append(beam)
                    new_scores.append(score)
            beams, scores = tuple(new_beams), tuple(new_scores)
        return tuple(sorted(finished + list(beams)))


N_MC = 20_000


def _setup(width: int) -> tuple[TableLM, tuple[int, ...]]:
    """Width 2: bigram, width 3: trigram; tables with exact zeros, chosen so that the exact
    distributions have a few hundred outcomes (enough structure, still testable at 2e4)."""
    order = 3 if width == 3 else 2
    table = random_table(np.random.default_rng(10 + width), 4, order, 1.5, zero_prob=0.15)
    return TableLM(table), tuple(range(order - 1))


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_monte_carlo_simulation_matches_enumeration(mode, width) -> None:
    lm, prompt = _setup(width)
    exact = beam_sampling_outcomes(lm, prompt, width, 3, mode, {EOS}, **FILTER)
    sim = BeamSamplingSimulator(lm, prompt, width, 3, mode, {EOS}, **FILTER)
    rng = np.random.default_rng(100 + width)
    samples = [sim.run(rng) for _ in range(N_MC)]
    assert_matches(samples, exact, f"beam outcomes {mode} W={width}")
    answers = [best_answer(s, lm, prompt) for s in samples]
    assert_matches(answers, best_answer_distribution(exact, lm, prompt), f"answers {mode}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "bug", "filt", "reason"),
    [
        # Duplicated beams are impossible in distinct mode: caught by the support check or TV.
        ("distinct", "force_replacement", FILTER, None),
        # Same support (no truncation), only the shape differs: must be caught by the TV test.
        ("with_replacement", "ignore_temperature", dict(temperature=0.8), "TV"),
        ("distinct", "ignore_temperature", dict(temperature=0.8), "TV"),
    ],
)
def test_harness_rejects_a_wrong_sampler(mode, bug, filt, reason) -> None:
    lm, prompt = _setup(2)
    filters = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **filt}
    exact = beam_sampling_outcomes(lm, prompt, 2, 3, mode, {EOS}, **filters)
    sim = BeamSamplingSimulator(lm, prompt, 2, 3, mode, {EOS}, **filters, **{bug: True})
    rng = np.random.default_rng(7)
    samples = [sim.run(rng) for _ in range(N_MC)]
    with pytest.raises(AssertionError, match=reason):
        assert_matches(samples, exact, f"{bug} must be caught")
