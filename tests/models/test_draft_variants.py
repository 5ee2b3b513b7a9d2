"""Cheaper drafts stay exact: a head over the K most frequent tokens, int8 linear layers.

Verification uses the q the draft computed, so any draft keeps DSBD exact. These tests check
the plumbing that makes that true for the two draft variants the project ships: a restricted
head answers K-wide distributions (`ForestLogprobs.support`), the draft side samples on them and
the verifier spreads them over the vocabulary; and DSBD with such a draft follows the target's
beam sampling in distribution (1e5 sessions on exact tables, as tests/algorithm/test_exactness.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from dsbd_core import (
    ForestLayer,
    ForestLogprobs,
    SamplingConfig,
    TableScorer,
    generate,
    generate_batch,
)
from dsbd_core.algorithm.draws.streams import Draws
from dsbd_core.algorithm.scorer import Roots
from dsbd_core.models.draft_variants import (
    RestrictedHead,
    compact_logits,
    output_size,
    quantize_int8,
    restrict_head,
)
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.exact_reference import (
    TableLM,
    assert_matches,
    beam_sampling_outcomes,
    random_table,
)
from tests.support.tiny_models import tiny_model

V, EOS, PROMPT, MAX_NEW, RUNS = 6, 0, [1], 3, 100_000


class SupportScorer:
    """A table draft that only ever proposes `support` (renormalised there), answered K-wide."""

    def __init__(self, table: np.ndarray, support: list[int]) -> None:
        self.support = torch.tensor(support)
        logp = torch.from_numpy(table)[..., self.support].log_softmax(-1)
        full = torch.full(table.shape, float("-inf"), dtype=torch.float64)
        full[..., self.support] = logp
        self.inner = TableScorer(full)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        self.inner.set_roots(roots)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        out = self.inner.forward(layers)
        roots = out.roots[..., self.support] if out.roots is not None else None
        return ForestLogprobs(roots, [x[..., self.support] for x in out.layers], self.support)

    def release(self) -> None:
        self.inner.release()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["distinct", "with_replacement"])
def test_dsbd_with_a_restricted_draft_head_equals_target_beam_sampling(mode: str) -> None:
    rng = np.random.default_rng(12)
    target = random_table(rng, V, 2, concentration=1.0)
    draft = SupportScorer(random_table(rng, V, 2, concentration=1.0), [0, 2, 3, 5])
    config = SamplingConfig(
        max_new_tokens=MAX_NEW,
        eos_token_ids=(EOS,),
        width=2,
        gamma=2,
        threshold=None,
        mode=mode,
        seed=5,
    )
    results = generate_batch(
        "dsbd", TableScorer(torch.from_numpy(target)), [PROMPT] * RUNS, config, draft
    )
    outcomes = [tuple(sorted(tuple(b.token_ids) for b in r.beams)) for r in results]
    exact = beam_sampling_outcomes(TableLM(target), PROMPT, 2, MAX_NEW, mode, {EOS})
    assert_matches(outcomes, exact, f"restricted draft head, {mode}")
    assert any(sum(r.stats.accepted_layers) > 0 for r in results[:1000])


def _tiny(seed: int) -> LlamaForCausalLM:
    return tiny_model(40, seed=seed)


def test_restricted_head_scores_only_its_tokens_and_switches_to_compact() -> None:
    model = _tiny(0)
    keep = torch.tensor([3, 1, 7, 7, 20])
    restrict_head(model, keep)
    head = model.get_output_embeddings()
    assert isinstance(head, RestrictedHead) and head.keep.tolist() == [1, 3, 7, 20]
    assert output_size(model) == 40
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, -1]
        with compact_logits(model) as support:
            compact = model(input_ids=ids).logits[0, -1]
    assert support.tolist() == [1, 3, 7, 20] and compact.shape == (4,)
    assert torch.isinf(full).sum() == 36 and torch.equal(full[support], compact)


def test_a_restricted_int8_draft_decodes_and_proposes_only_its_tokens() -> None:
    target, draft = _tiny(1), _tiny(1)
    keep = torch.arange(0, 40, 2)  # even tokens only
    quantize_int8(restrict_head(draft, keep))
    config = SamplingConfig(width=2, gamma=3, threshold=None, max_new_tokens=12, seed=3)
    result = generate(
        "dsbd", TransformerScorer(target), [1, 2, 3], config, TransformerScorer(draft)
    )
    assert result.stats.drafted_tokens > 0 and result.stats.tokens_emitted == 12
    # The draft proposes even tokens only; the target may still emit odd ones (fallback draws).
    plain = generate(
        "dsbd", TransformerScorer(target), [1, 2, 3], config, TransformerScorer(_tiny(1))
    )
    assert len(plain.best.token_ids) == len(result.best.token_ids) == 12


def _lumped(target: torch.Tensor, table: torch.Tensor, support: torch.Tensor, vocab: int):
    """What verify_forest hands the width rules for a restricted head: the support's columns
    and one column with the target's mass outside them."""
    batch, parents = target.shape[0], target.shape[1] // vocab
    p = target.view(batch, parents, vocab)[:, :, support].reshape(batch, -1)
    q = table.view(batch, parents, vocab)[:, :, support].reshape(batch, -1)
    outside = target.sum(1, keepdim=True) - p.sum(1, keepdim=True)
    return torch.cat([p, outside], 1), torch.cat([q, torch.zeros_like(outside)], 1)


def test_width_rules_on_the_support_equal_the_full_layer() -> None:
    """One column for the target mass outside the draft's support changes nothing the width
    rules compute: the i.i.d. DP is identical, the distinct estimate agrees within its noise."""
    from dsbd_core.algorithm.iteration.width import acceptance_alphas, layer_width
    from dsbd_core.algorithm.iteration.width_distinct import distinct_count_tails

    gen = torch.Generator().manual_seed(3)
    vocab, parents = 50, 3
    support = torch.arange(0, vocab, 3)
    target = torch.rand(2, parents * vocab, generator=gen, dtype=torch.float64) ** 4
    target /= target.sum(1, keepdim=True)
    table = torch.zeros_like(target).view(2, parents, vocab)
    table[:, :, support] = (
        torch.rand(2, parents, support.numel(), generator=gen, dtype=torch.float64) ** 4
    )
    table = table.view(2, -1) / table.view(2, -1).sum(1, keepdim=True)
    p, q = _lumped(target, table, support, vocab)
    full = acceptance_alphas(target, table, 4)
    torch.testing.assert_close(acceptance_alphas(p, q, 4), full, rtol=0, atol=1e-12)
    drafts, w_max = torch.tensor([4, 4]), torch.tensor([3, 3])
    assert torch.equal(
        layer_width(p, q, drafts, 4, 0.6, 1, w_max),
        layer_width(target, table, drafts, 4, 0.6, 1, w_max),
    )
    tails = [
        distinct_count_tails(x, y, None, drafts, 4, Draws.seeded(1), samples=4000)
        for x, y in ((target, table), (p, q))
    ]
    assert (tails[0] - tails[1]).abs().max() < 0.05
