"""TransformerScorer against the plain model: forest pass, padding, draft/target.

Every check compares with the model run without any cache on the node's (or beam's) full token
sequence (ALGORITHM.md §12.3 items 12 and 13), on tiny random float64 Llama / Qwen2 models, so the
only tolerated difference is floating-point reordering (< 1e-6; measured ~1e-15 for sdpa, ~3e-8 for
eager, whose softmax runs in float32 even for a float64 model). Cache compaction across iterations
is tested in test_transformer_scorer_cache.py; the shared cases are in forest_cases.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dsbd_core.algorithm.scorer import ForestLayer, ForestScorer
from dsbd_core.algorithm.scorer import Roots as ForestRoots
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.forest_cases import MODELS, TOL, VOCAB, check_forest, get_model, standard_case

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- tests


def test_protocol_and_basics() -> None:
    scorer = TransformerScorer(get_model("llama"))
    assert isinstance(scorer, ForestScorer)
    assert scorer.vocab_size == VOCAB
    assert not scorer.model.training


def test_refuses_sliding_window_models() -> None:
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        attn_implementation="sdpa",
    )
    with pytest.raises(ValueError, match="full-attention"):
        TransformerScorer(Qwen2ForCausalLM(config))


@pytest.mark.parametrize(("arch", "attn"), MODELS)
def test_forest_pass_equals_each_path(arch: str, attn: str) -> None:
    model = get_model(arch, attn)
    roots, layers = standard_case(seed=1)
    scorer = TransformerScorer(model)
    scorer.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, None))
    out = scorer.forward(layers)
    assert out.roots is not None and out.roots.dtype == torch.float64
    assert [x.shape for x in out.layers] == [(2, 5, VOCAB)] * 3
    assert scorer.forward_calls == 1  # one model forward for all sessions together
    assert check_forest(model, roots, layers, out.roots, out.layers) < TOL
    # Dead rows and padding nodes are zeros (finite), as the contract allows.
    assert torch.all(out.roots[~roots.alive] == 0)
    assert torch.all(out.layers[0][~layers[0].exists] == 0)


def test_padding_never_leaks() -> None:
    model = get_model("qwen2")
    roots, layers = standard_case(seed=2)
    base = TransformerScorer(model)
    base.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, None))
    expected = base.forward(layers)

    gen = torch.Generator().manual_seed(7)
    noisy_tokens = roots.tokens.clone()
    dead = ~roots.alive
    noisy_tokens[dead] = torch.randint(0, VOCAB, noisy_tokens[dead].shape, generator=gen)
    for b in range(2):  # columns past the session's length
        length = int(roots.lengths[b])
        tail = noisy_tokens[b, :, length:]
        noisy_tokens[b, :, length:] = torch.randint(0, VOCAB, tail.shape, generator=gen)
    noisy_layers = []
    for layer in layers:
        token = layer.token.clone()
        token[~layer.exists] = torch.randint(0, VOCAB, token[~layer.exists].shape, generator=gen)
        noisy_layers.append(ForestLayer(layer.parent, token, layer.exists))

    other = TransformerScorer(model)
    other.set_roots(ForestRoots(noisy_tokens, roots.lengths, roots.alive, None))
    got = other.forward(noisy_layers)
    assert got.roots is not None and expected.roots is not None
    assert torch.equal(got.roots[roots.alive], expected.roots[roots.alive])
    for layer, a, e in zip(layers, got.layers, expected.layers, strict=True):
        assert torch.equal(a[layer.exists], e[layer.exists])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_style_equals_target_style(arch: str) -> None:
    model = get_model(arch)
    roots, layers = standard_case(seed=3)
    target = TransformerScorer(model)
    target.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, None))
    expected = target.forward(layers)

    draft = TransformerScorer(model)
    draft.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, None))
    first = draft.forward([])
    assert first.roots is not None and first.layers == []
    assert expected.roots is not None
    assert (first.roots - expected.roots).abs().max() < TOL
    for layer, want in zip(layers, expected.layers, strict=True):
        step = draft.forward([layer])
        assert step.roots is None  # roots were fed by the first call
        assert (step.layers[0] - want).abs().max() < TOL
    assert draft.forward_calls == 1 + len(layers)  # each call: one forward, both sessions
