"""End-to-end exactness: DSBD (fixed width) follows target beam sampling in distribution.

ALGORITHM.md §12.1 items 4-7. Each test decodes 1e5 independent sessions in one batched engine
call on exact n-gram tables (|V| = 4) and compares the distribution of the whole final beam multiset
with the exact enumeration in `exact_reference` (independent code), at the threshold given by a
null run of an exact sampler at the same sample size. The engine's own beam sampling is checked
against the same enumeration (the "null run of the exact sampler"). And the same on float32 tables
(what a bfloat16 or float32 model's scorer hands the engine; last section).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from dsbd_core import (
    ForestLayer,
    ForestLogprobs,
    ForestScorer,
    SamplingConfig,
    TableScorer,
    generate_batch,
)
from dsbd_core.algorithm.scorer import Roots
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from tests.support.beam_search import outcomes_of
from tests.support.exact_reference import (
    TableLM,
    assert_matches,
    beam_sampling_outcomes,
    best_answer_distribution,
    multinomial_outcomes,
    random_table,
)

RUNS = 100_000
V = 4
EOS = 0
PROMPT = [1]
MAX_NEW = 3


def tables(seed: int, draft_zero_prob: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """A target bigram table and a different draft table (with exact zeros where the target
    has mass)."""
    rng = np.random.default_rng(seed)
    target = random_table(rng, V, 2, concentration=1.0)
    draft = random_table(rng, V, 2, concentration=1.0, zero_prob=draft_zero_prob)
    return target, draft


def decode(
    method: str,
    target: np.ndarray,
    draft: np.ndarray | ForestScorer | None,
    prompt: list[int] = PROMPT,
    **config,
) -> list:
    """RUNS sessions of `prompt` in one call; `draft`: a table, or a scorer (NgramDraft)."""
    cfg = SamplingConfig(
        max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), seed=config.pop("seed", 0), **config
    )
    draft_scorer = TableScorer(torch.from_numpy(draft)) if isinstance(draft, np.ndarray) else draft
    return generate_batch(
        method, TableScorer(torch.from_numpy(target)), [prompt] * RUNS, cfg, draft_scorer
    )


def exact_beam(
    target: np.ndarray, width: int, mode: str, prompt: list[int] = PROMPT, **filters
) -> dict:
    return beam_sampling_outcomes(TableLM(target), prompt, width, MAX_NEW, mode, {EOS}, **filters)


GRID = [(w, g) for w in (1, 2, 3) for g in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
@pytest.mark.parametrize(("width", "gamma"), GRID)
def test_fixed_width_dsbd_equals_target_beam_sampling(mode: str, width: int, gamma: int) -> None:
    target, draft = tables(seed=10 * width + gamma)
    results = decode(
        "dsbd",
        target,
        draft,
        width=width,
        gamma=gamma,
        threshold=None,
        mode=mode,
        seed=width * 7 + gamma,
    )
    exact = exact_beam(target, width, mode)
    assert_matches(outcomes_of(results), exact, f"dsbd {mode} W={width} gamma={gamma}")
    # and it did speculate: some iterations accepted draft layers
    assert any(sum(r.stats.accepted_layers) > 0 for r in results[:1000])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
@pytest.mark.parametrize("width", [1, 2, 3])
def test_engine_beam_sampling_is_the_exact_sampler(mode: str, width: int) -> None:
    """The null run: our beam-sampling baseline against the enumeration."""
    target, _ = tables(seed=3)
    results = decode("beam", target, None, width=width, mode=mode, seed=width)
    assert_matches(outcomes_of(results), exact_beam(target, width, mode), f"beam {mode} W={width}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["with_replacement", "distinct"])
def test_dsbd_with_temperature_top_k_top_p_follows_filtered_beam_sampling(mode: str) -> None:
    target, draft = tables(seed=21)
    filters = {"temperature": 0.8, "top_k": 6, "top_p": 0.9}
    results = decode(
        "dsbd", target, draft, width=2, gamma=2, threshold=None, mode=mode, seed=4, **filters
    )
    exact = exact_beam(target, 2, mode, **filters)
    assert_matches(outcomes_of(results), exact, f"dsbd filtered {mode}")


@pytest.mark.slow
def test_returned_answer_follows_the_exact_answer_distribution() -> None:
    target, draft = tables(seed=5)
    results = decode("dsbd", target, draft, width=3, gamma=2, threshold=None, seed=9)
    answers = best_answer_distribution(exact_beam(target, 3, "distinct"), TableLM(target), PROMPT)
    assert_matches([tuple(r.best.token_ids) for r in results], answers, "best answer")


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_width_one_dsbd_and_sps_are_multinomial_sampling(gamma: int) -> None:
    target, draft = tables(seed=30 + gamma)
    exact = multinomial_outcomes(TableLM(target), PROMPT, MAX_NEW, {EOS})
    for method, extra in (
        ("sps", {}),
        ("dsbd", {"width": 1, "threshold": None}),
        ("dsbd", {"width": 1, "lean_memory": True}),
        ("sample", {}),
    ):
        results = decode(method, target, draft, gamma=gamma, seed=gamma, **extra)
        samples = [tuple(r.best.token_ids) for r in results]
        assert all(len(r.beams) == 1 for r in results[:1000])
        assert_matches(samples, exact, f"{method} {extra} gamma={gamma}")


@pytest.mark.slow
def test_draft_equal_to_target_accepts_every_layer() -> None:
    """ALGORITHM.md §12.1 item 6: with consistent definitions Q == P, so every draft is accepted and
    each iteration emits gamma + 1 tokens per beam; output still exact."""
    target, _ = tables(seed=40)
    gamma, width = 2, 2
    cfg = {"width": width, "gamma": gamma, "threshold": None, "mode": "with_replacement"}
    results = decode("dsbd", target, target, **cfg, seed=1)
    for r in results[:2000]:
        st = r.stats
        # every draft tried against the target is accepted: each layer gets its K at once
        assert st.accepted_tokens == sum(sum(widths) for widths in st.widths)
        assert st.accepted_layers[0] == gamma or any(b.finished for b in r.beams)
    full = [r for r in results if not any(b.finished for b in r.beams)]
    assert full and all(r.stats.iterations == 1 and r.stats.tokens_emitted == 3 for r in full)
    assert_matches(outcomes_of(results), exact_beam(target, width, "with_replacement"), "q == p")


@pytest.mark.slow
def test_disjoint_supports_emit_one_token_per_iteration_and_stay_exact() -> None:
    """ALGORITHM.md §12.1 item 7: the draft only proposes what the target never emits."""
    logp = np.full((V, V), -np.inf)
    logp[:, 0], logp[:, 1] = np.log(0.3), np.log(0.7)  # target: tokens {0, 1}
    draft = np.full((V, V), -np.inf)
    draft[:, 2], draft[:, 3] = np.log(0.5), np.log(0.5)  # draft: tokens {2, 3}
    results = decode("dsbd", logp, draft, width=2, gamma=3, threshold=0.7, w_min=1, seed=2)
    for r in results[:2000]:
        assert r.stats.accepted_tokens == 0
        assert r.stats.accepted_layers == [0] * r.stats.iterations
        assert r.stats.tokens_emitted == r.stats.iterations  # one token per iteration
        # W_L = w_min whenever a layer is verified (the last token's iteration drafts nothing)
        assert all(widths in ([1], []) for widths in r.stats.widths)
        assert r.stats.widths[0] == [1]
    # with zero acceptance the residual is P, so even dynamic width is plain beam sampling
    assert_matches(outcomes_of(results), exact_beam(logp, 2, "distinct"), "disjoint supports")


# The prompt-lookup draft (issue 48): [1] has no match at the first iteration (an empty first
# layer: a beam step's tokens), later contexts match where tokens repeat; the longer prompt
# matches at once, with n-grams of 1 and 2. Dynamic width and lean memory at W > 1 have a law of
# their own (random-width beam sampling, ALGORITHM.md §4.4): test_reference_iteration decodes
# them with the n-gram draft draw for draw against the reference.
NGRAM_PROMPTS = [[1], [1, 2, 1, 3, 1, 2]]
NGRAM_CASES = [
    ("distinct-w3-g3", {"width": 3, "gamma": 3, "mode": "distinct"}),
    ("distinct-w2-g2-ws3", {"width": 2, "gamma": 2, "draft_width": 3, "mode": "distinct"}),
    ("iid-w2-g2", {"width": 2, "gamma": 2, "mode": "with_replacement"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", NGRAM_PROMPTS, ids=["no-match-first", "matches"])
@pytest.mark.parametrize(("name", "knobs"), NGRAM_CASES, ids=[c[0] for c in NGRAM_CASES])
def test_fixed_width_dsbd_with_the_ngram_draft_equals_target_beam_sampling(
    prompt: list[int], name: str, knobs: dict
) -> None:
    target, _ = tables(seed=53)  # p(1 | 1) = 0.36: the repeats the draft proposes pass
    draft = NgramDraft(V, ngram_max=2)
    results = decode("dsbd", target, draft, prompt, seed=len(prompt), threshold=None, **knobs)
    exact = exact_beam(target, knobs["width"], knobs["mode"], prompt)
    assert_matches(outcomes_of(results), exact, f"dsbd ngram {name} prompt={prompt}")
    assert any(r.stats.accepted_tokens > 0 for r in results[:1000])  # it drafted, and passed
    if prompt == [1]:  # nothing to match at the first iteration: its layers were empty
        assert all(r.stats.accepted_layers[0] == 0 for r in results[:1000])


@pytest.mark.slow
@pytest.mark.parametrize("prompt", NGRAM_PROMPTS, ids=["no-match-first", "matches"])
def test_width_one_methods_with_the_ngram_draft_are_multinomial_sampling(
    prompt: list[int],
) -> None:
    target, _ = tables(seed=53)
    exact = multinomial_outcomes(TableLM(target), prompt, MAX_NEW, {EOS})
    for method, extra in (("sps", {}), ("dsbd", {"width": 1, "lean_memory": True})):
        results = decode(method, target, NgramDraft(V), prompt, gamma=3, seed=2, **extra)
        samples = [tuple(r.best.token_ids) for r in results]
        assert_matches(samples, exact, f"{method} {extra} ngram {prompt}")
        assert any(r.stats.accepted_tokens > 0 for r in results[:1000])


# Float32 tables: what a bfloat16 or float32 model's scorer hands the engine. The engine keeps the
# candidate tables in the dtype the scorer returns (float32 for every real model that is not
# float64) and accumulates the beams' log-likelihoods in float64. The statistical check of fixed
# width with the exact n-gram tables rounded to float32 on the way out of the scorer: DSBD must
# still follow the (float32-rounded) target's beam sampling, at the threshold of a null run of an
# exact sampler at the same sample size.


class Float32Scorer:
    """A TableScorer whose log-probabilities come out in float32, like a real model's."""

    def __init__(self, table: np.ndarray) -> None:
        rounded = torch.from_numpy(table).to(torch.float32).log_softmax(-1)
        self.table = rounded.to(torch.float64).numpy()  # what the engine really samples from
        self.inner = TableScorer(torch.from_numpy(self.table))

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        self.inner.set_roots(roots)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        out = self.inner.forward(layers)
        roots = out.roots.to(torch.float32) if out.roots is not None else None
        return ForestLogprobs(roots, [x.to(torch.float32) for x in out.layers])

    def release(self) -> None:
        self.inner.release()


def decode_float32(
    method: str, target: Float32Scorer, draft: Float32Scorer | None, **fields
) -> list:
    config = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), **fields)
    return generate_batch(method, target, [PROMPT] * RUNS, config, draft)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "width", "gamma"),
    [
        ("distinct", 3, 2),
        ("distinct", 2, 3),
        ("with_replacement", 2, 2),
    ],
)
def test_fixed_width_dsbd_on_float32_tables_equals_target_beam_sampling(
    mode: str, width: int, gamma: int
) -> None:
    rng = np.random.default_rng(100 + width + gamma)
    target = Float32Scorer(random_table(rng, V, 2, concentration=1.0))
    draft = Float32Scorer(random_table(rng, V, 2, concentration=1.0, zero_prob=0.3))
    results = decode_float32(
        "dsbd", target, draft, width=width, gamma=gamma, threshold=None, mode=mode, seed=3
    )
    assert all(r.beams[0].log_likelihood <= 0 for r in results[:100])
    exact = beam_sampling_outcomes(TableLM(target.table), PROMPT, width, MAX_NEW, mode, {EOS})
    assert_matches(outcomes_of(results), exact, f"float32 dsbd {mode} W={width} gamma={gamma}")
    assert any(sum(r.stats.accepted_layers) > 0 for r in results[:1000])


def test_scores_stay_float64_log_likelihoods() -> None:
    """The returned log-likelihood is the float64 sum of the tokens' log-probabilities."""
    rng = np.random.default_rng(7)
    target = Float32Scorer(random_table(rng, V, 2, concentration=1.0))
    draft = Float32Scorer(random_table(rng, V, 2, concentration=1.0))
    config = SamplingConfig(
        max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), width=2, gamma=2, threshold=None, seed=1
    )
    (result,) = generate_batch("dsbd", target, [PROMPT], config, draft)
    for beam in result.beams:
        context, total = PROMPT[-1], 0.0
        for token in beam.token_ids:
            total += float(target.table[context, token])
            context = token
        assert beam.log_likelihood == pytest.approx(total, abs=1e-6)
