"""Behaviour of the engine that is not a distribution: EOS, budgets, seeds, stats, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer, generate, generate_batch
from tests.support.exact_reference import random_table
from tests.support.table_scorers import scorers

V, EOS = 6, 0


CONFIGS = [
    {"width": 3, "gamma": 3, "threshold": 0.7, "mode": "distinct"},
    {"width": 3, "gamma": 2, "threshold": None, "mode": "with_replacement"},
    {"width": 4, "draft_width": 6, "gamma": 3, "threshold": 0.9, "w_min": 2},
    {"width": 3, "gamma": 3, "lean_memory": True},
]


@pytest.mark.slow
@pytest.mark.parametrize("extra", CONFIGS)
@pytest.mark.parametrize("method", ["dsbd", "beam"])
def test_beams_end_at_their_first_eos_and_respect_the_budget(method: str, extra: dict) -> None:
    target, draft = scorers()
    cfg = SamplingConfig(max_new_tokens=7, eos_token_ids=(EOS,), seed=3, **extra)
    for r in generate_batch(method, target, [[1, 2], [3, 4, 5]] * 200, cfg, draft):
        assert r.beams, "a decode always returns at least one beam"
        for beam in r.beams:
            assert 1 <= len(beam.token_ids) <= 7
            assert EOS not in beam.token_ids[:-1], "no token after EOS"
            assert beam.finished == (beam.token_ids[-1] == EOS)
            assert beam.finished or len(beam.token_ids) == 7
        if method == "beam" or not extra.get("lean_memory"):
            assert len(r.beams) <= extra["width"] or extra.get("mode") == "with_replacement"
        scores = [b.score for b in r.beams]
        assert scores == sorted(scores, reverse=True), "beams come best-first"


def test_log_likelihoods_are_true_target_log_probabilities() -> None:
    rng = np.random.default_rng(1)
    table = random_table(rng, V, 2, concentration=0.8)
    target = TableScorer(torch.from_numpy(table))
    draft = TableScorer(torch.from_numpy(random_table(rng, V, 2, concentration=0.8)))
    cfg = SamplingConfig(
        max_new_tokens=6,
        eos_token_ids=(EOS,),
        seed=5,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        length_penalty=0.5,
    )
    for r in generate_batch("dsbd", target, [[2]] * 50, cfg, draft):
        for beam in r.beams:
            prev, total = 2, 0.0
            for tok in beam.token_ids:
                total += float(table[prev, tok])
                prev = tok
            assert abs(beam.log_likelihood - total) < 1e-9
            assert abs(beam.score - total / len(beam.token_ids) ** 0.5) < 1e-9


@pytest.mark.parametrize("method", ["dsbd", "beam", "sps", "sample"])
def test_same_seed_same_output_and_other_seed_differs(method: str) -> None:
    target, draft = scorers(2)

    def run(seed: int) -> list:
        cfg = SamplingConfig(max_new_tokens=8, eos_token_ids=(EOS,), seed=seed, width=3)
        results = generate_batch(method, target, [[1, 2]] * 20, cfg, draft)
        return [[(b.token_ids, b.log_likelihood) for b in r.beams] for r in results]

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.slow
def test_stats_add_up() -> None:
    target, draft = scorers(3)
    cfg = SamplingConfig(max_new_tokens=12, seed=0, width=3, gamma=3, threshold=0.6)
    for r in generate_batch("dsbd", target, [[1, 2]] * 100, cfg, draft):
        st = r.stats
        assert st.target_forward_passes == st.iterations == len(st.accepted_layers)
        assert st.tokens_emitted == sum(a + 1 for a in st.accepted_layers) == 12
        assert all(0 <= a <= 3 for a in st.accepted_layers)
        assert st.draft_forward_passes <= 3 * st.iterations
        assert st.accepted_tokens <= st.drafted_tokens
        for widths, accepted in zip(st.widths, st.accepted_layers, strict=True):
            assert len(widths) in (accepted, accepted + 1)
            assert all(1 <= w <= 3 for w in widths)
        assert max(len(b.token_ids) for b in r.beams) == st.tokens_emitted
    beam = generate("beam", target, [1, 2], cfg)
    assert beam.stats.target_forward_passes == beam.stats.tokens_emitted == 12
    assert beam.stats.draft_forward_passes == 0


def test_lean_memory_keeps_one_beam_between_iterations() -> None:
    target, draft = scorers(4)
    cfg = SamplingConfig(max_new_tokens=10, seed=1, width=3, gamma=3, lean_memory=True)
    kept_rows = []
    original = target.set_roots

    def spy(roots):
        kept_rows.append(int(roots.alive.sum(dim=1).max()))
        return original(roots)

    target.set_roots = spy  # type: ignore[method-assign]
    r = generate("dsbd", target, [1, 2], cfg, draft)
    assert kept_rows and all(rows == 1 for rows in kept_rows)
    assert r.stats.tokens_emitted == 10


def test_bad_input_is_refused_clearly() -> None:
    target, draft = scorers()
    cfg = SamplingConfig(max_new_tokens=3)
    with pytest.raises(ValueError, match="draft model"):
        generate("dsbd", target, [1, 2], cfg)
    with pytest.raises(ValueError, match="method='greedy'"):
        generate("greedy", target, [1, 2], cfg)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token id 99 out of range"):
        generate("beam", target, [1, 99], cfg)
    with pytest.raises(ValueError, match="empty prompt"):
        generate("beam", target, [], cfg)
    small = TableScorer(torch.log_softmax(torch.randn(4, 4, dtype=torch.float64), -1))
    with pytest.raises(ValueError, match="vocabulary size 4 != target vocabulary size 6"):
        generate("dsbd", target, [1, 2], cfg, small)
