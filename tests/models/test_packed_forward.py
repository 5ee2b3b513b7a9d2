"""Uneven forests run packed into one row and give what each path gives alone.

`packed_forward` replaces a mostly-padded forest input by one row of real tokens whose keys are
the rows' caches end to end. It must change nothing but the cost: every root's and node's
log-probabilities equal the model run on the node's whole sequence without a cache (tolerance of
tests/support/forest_cases.py), and a decode with packing draws exactly what one without draws.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsbd_core import SamplingConfig, generate
from dsbd_core.algorithm.scorer import ForestLayer
from dsbd_core.algorithm.scorer import Roots as ForestRoots
from dsbd_core.models import packed_forward as packed_module
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.forest_cases import MODELS, TOL, check_forest, get_model, random_roots


def uneven_forest(seed: int) -> tuple:
    """Two sessions whose layers hang mostly under one root: mostly padding when padded."""
    rng = random.Random(seed)
    roots = random_roots(rng, [7, 5], [[True, True, True], [True, True, False]])
    layers, parents = [], [[0, 0, 0, 0, 1], [0, 0, 0, 1, 0]]
    for depth in range(3):
        parent = torch.tensor(parents) if depth == 0 else torch.tensor([[0, 1, 2, 3, 4]] * 2)
        token = torch.tensor([[rng.randrange(16) for _ in range(5)] for _ in range(2)])
        exists = torch.ones(2, 5, dtype=torch.bool)
        layers.append(ForestLayer(parent, token, exists))
    return roots, layers


@pytest.mark.parametrize(("arch", "attn"), MODELS)
def test_a_packed_forest_equals_each_path(arch: str, attn: str, monkeypatch) -> None:
    model = get_model(arch, attn)
    roots, layers = uneven_forest(seed=4)
    calls = []
    real = packed_module.packed_forward

    def spy(*args, **kwargs):
        calls.append([part.input_ids.shape for part in args[1]])
        return real(*args, **kwargs)

    monkeypatch.setattr("dsbd_core.models.transformer_scorer.packed_forward", spy)
    scorer = TransformerScorer(model)
    scorer.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, None))
    out = scorer.forward(layers)
    assert calls, "the uneven forest should have run packed"
    assert check_forest(model, roots, layers, out.roots, out.layers) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decodes_with_and_without_packing_draw_the_same(arch: str) -> None:
    model = get_model(arch)
    draft = get_model("qwen2" if arch == "llama" else "llama")
    config = SamplingConfig(
        width=3, draft_width=5, gamma=3, threshold=None, max_new_tokens=14, seed=2
    )
    results = [
        generate(
            "dsbd",
            TransformerScorer(model, pack=pack),
            [3, 1, 4, 1, 5],
            config,
            TransformerScorer(draft, pack=pack),
        )
        for pack in (True, False)
    ]
    packed, padded = results
    assert [b.token_ids for b in packed.beams] == [b.token_ids for b in padded.beams]
    for a, b in zip(packed.beams, padded.beams, strict=True):
        assert a.log_likelihood == pytest.approx(b.log_likelihood, abs=1e-9)
    assert packed.stats.as_dict() == padded.stats.as_dict()


def test_forests_of_several_trees_run_packed() -> None:
    assert not packed_module.worth_packing(torch.ones(4, 1, dtype=torch.bool))  # a beam step
    assert not packed_module.worth_packing(torch.ones(1, 6, dtype=torch.bool))  # one row
    uneven = torch.zeros(3, 8, dtype=torch.bool)
    uneven[0], uneven[1:, :2] = True, True
    assert packed_module.worth_packing(uneven)
