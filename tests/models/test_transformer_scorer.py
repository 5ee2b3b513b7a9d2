"""TransformerScorer against the plain model: forest pass, padding, draft/target, and its KV
caches across iterations (compaction to accepted paths, re-prefills).

Every check compares with the model run without any cache on the node's (or beam's) full token
sequence (ALGORITHM.md §12.3 items 12 and 13), on tiny random float64 Llama / Qwen2 models, so the
only tolerated difference is floating-point reordering (< 1e-6; measured ~1e-15 for sdpa, ~3e-8 for
eager, whose softmax runs in float32 even for a float64 model). After `set_roots`, each kept cache
row must equal a fresh prefill of the beam's leading tokens. The shared cases are in
tests/support/forest_cases.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dsbd_core.algorithm.scorer import ForestLayer, ForestScorer, Origin
from dsbd_core.algorithm.scorer import Roots as ForestRoots
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.forest_cases import (
    MODELS,
    TOL,
    VOCAB,
    Pick,
    Roots,
    check_forest,
    get_model,
    node_path,
    random_forest,
    random_roots,
    standard_case,
)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- one iteration


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


# ----------------------------------------------------------------------------- compaction


def feed(
    scorer: TransformerScorer, layers: list[ForestLayer], style: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The forward calls of one iteration as the engine makes them (after `set_roots`).

    target: one forward over all layers; draft: `forward([])` then one forward per layer, except
    the last layer, which a draft samples but never feeds.
    """
    if style == "target":
        out = scorer.forward(layers)
        assert out.roots is not None
        return out.roots, out.layers
    first = scorer.forward([])
    assert first.roots is not None
    outs = [scorer.forward([layer]).layers[0] for layer in layers[:-1]]
    return first.roots, outs


def run_iteration(
    scorer: TransformerScorer,
    roots: Roots,
    layers: list[ForestLayer],
    origin: Origin | None,
    style: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    scorer.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, origin))
    return feed(scorer, layers, style)


def grow(roots: Roots, layers: list[ForestLayer], picks: list[list[Pick]]) -> tuple[Roots, Origin]:
    """New beams from (old root, path nodes at layers 1..d, new token) per session.

    All picks of a session must have the same depth d (beams of a session are equally long).
    """
    batch = len(picks)
    root_count = max(len(p) for p in picks)
    depth_max = len(layers)
    lengths = []
    for b in range(batch):
        depths = {len(path) for _, path, _ in picks[b]}
        assert len(depths) <= 1
        lengths.append(int(roots.lengths[b]) + (depths.pop() if depths else 0) + 1)
    width = max(lengths) + 1
    tokens = torch.zeros(batch, root_count, width, dtype=torch.long)
    alive = torch.zeros(batch, root_count, dtype=torch.bool)
    origin_root = torch.zeros(batch, root_count, dtype=torch.long)
    origin_path = torch.full((batch, root_count, depth_max), -1, dtype=torch.long)
    for b in range(batch):
        for o, (root, path, new_token) in enumerate(picks[b]):
            seq = roots.tokens[b, root, : int(roots.lengths[b])].tolist()
            seq += [int(layers[i].token[b, node]) for i, node in enumerate(path)] + [new_token]
            tokens[b, o, : len(seq)] = torch.tensor(seq)
            alive[b, o] = True
            origin_root[b, o] = root
            origin_path[b, o, : len(path)] = torch.tensor(path, dtype=torch.long)
    return Roots(tokens, torch.tensor(lengths), alive), Origin(origin_root, origin_path)


def leaf_pick(layers: list[ForestLayer], b: int, depth: int, m: int, new_token: int) -> Pick:
    """The new beam that accepts the path to node m of layer `depth`, then `new_token`."""
    root, path = node_path(layers, b, depth, m)
    return (root, path, new_token)


def existing(layer: ForestLayer, b: int) -> list[int]:
    return [int(i) for i in layer.exists[b].nonzero().squeeze(1)]


def compaction_picks(layers: list[ForestLayer]) -> list[list[Pick]]:
    """Session 0: paths through the last layer, two beams in one tree (duplicate cache rows);
    session 1: branch at layer 0 (no path node), two beams of the same root;
    session 2: paths of depth 2 of 3."""
    deepest = len(layers)
    last = existing(layers[-1], 0)
    tree_of = {m: node_path(layers, 0, deepest, m)[0] for m in last}
    same_tree = [m for m in last if tree_of[m] == tree_of[last[0]]]
    session0 = [
        leaf_pick(layers, 0, deepest, last[0], 3),
        leaf_pick(layers, 0, deepest, last[0], 9),
    ]
    if len(same_tree) > 1:
        session0.append(leaf_pick(layers, 0, deepest, same_tree[1], 4))
    session0.append(leaf_pick(layers, 0, deepest, last[-1], 5))
    root1 = int(layers[0].parent[1, existing(layers[0], 1)[0]])
    session1 = [(root1, [], 1), (root1, [], 2)]
    mids = existing(layers[1], 2)
    session2 = [leaf_pick(layers, 2, 2, mids[-1], 6), leaf_pick(layers, 2, 2, mids[0], 7)]
    return [session0, session1, session2]


def check_cache_matches_prefill(
    model: torch.nn.Module, scorer: TransformerScorer, roots: Roots, expect_kept: list[int]
) -> float:
    """Each kept cache row equals a fresh prefill of the beam's first `kept` tokens."""
    worst = 0.0
    for b in range(roots.alive.shape[0]):
        cache, column_tokens = scorer.session_cache(b)
        kept = column_tokens.shape[1]
        assert kept == expect_kept[b], (b, kept, expect_kept[b])
        if kept == 0:
            assert cache is None
            continue
        for row, r in enumerate(roots.alive[b].nonzero().squeeze(1).tolist()):
            seq = roots.tokens[b, r, :kept]
            assert torch.equal(column_tokens[row], seq)
            with torch.inference_mode():
                fresh = model(input_ids=seq[None], use_cache=True).past_key_values
            for mine, theirs in zip(cache.layers, fresh.layers, strict=True):
                worst = max(worst, float((mine.keys[row] - theirs.keys[0]).abs().max()))
                worst = max(worst, float((mine.values[row] - theirs.values[0]).abs().max()))
    return worst


@pytest.mark.parametrize("style", ["target", "draft"])
def test_compaction_keeps_accepted_paths(style: str) -> None:
    model = get_model("llama")
    rng = random.Random(4)
    roots = random_roots(
        rng, [4, 6, 5], [[True, True, False], [False, True, True], [True, True, True]]
    )
    layers = random_forest(rng, roots, depth=3, max_nodes=5)
    scorer = TransformerScorer(model)
    run_iteration(scorer, roots, layers, None, style)

    new_roots, origin = grow(roots, layers, compaction_picks(layers))
    scorer.set_roots(ForestRoots(new_roots.tokens, new_roots.lengths, new_roots.alive, origin))
    fed_depth = 3 if style == "target" else 2  # the draft never feeds the last layer
    old = roots.lengths.tolist()
    expect_kept = [old[0] + fed_depth, old[1], old[2] + 2]
    assert check_cache_matches_prefill(model, scorer, new_roots, expect_kept) < TOL

    calls = scorer.forward_calls
    out = scorer.forward([])
    assert scorer.forward_calls == calls + 1  # the three sessions share one forward
    assert check_forest(model, new_roots, [], out.roots, []) < TOL


@pytest.mark.parametrize("lie", ["other_root", "dead_root"])
def test_mismatching_origin_reprefills(lie: str) -> None:
    model = get_model("qwen2")
    rng = random.Random(5)
    roots = random_roots(
        rng, [4, 6, 5], [[True, True, False], [False, True, True], [True, True, True]]
    )
    layers = random_forest(rng, roots, depth=3, max_nodes=5)
    scorer = TransformerScorer(model)
    run_iteration(scorer, roots, layers, None, "target")
    new_roots, origin = grow(roots, layers, compaction_picks(layers))
    # Session 1 claims its beams come from another root (whose tokens differ) or a dead one.
    wrong_root = 2 if int(origin.root[1, 0]) == 1 else 1
    if lie == "dead_root":
        wrong_root = 0
    assert not torch.equal(roots.tokens[1, wrong_root, :6], roots.tokens[1, origin.root[1, 0], :6])
    origin.root[1] = wrong_root
    scorer.set_roots(ForestRoots(new_roots.tokens, new_roots.lengths, new_roots.alive, origin))
    old = roots.lengths.tolist()
    assert check_cache_matches_prefill(model, scorer, new_roots, [old[0] + 3, 0, old[2] + 2]) < TOL
    out = scorer.forward([])
    assert check_forest(model, new_roots, [], out.roots, []) < TOL

    # No origin at all: every session is prefilled again, still exact.
    scorer.set_roots(ForestRoots(new_roots.tokens, new_roots.lengths, new_roots.alive, None))
    assert check_cache_matches_prefill(model, scorer, new_roots, [0, 0, 0]) == 0.0
    out = scorer.forward([])
    assert check_forest(model, new_roots, [], out.roots, []) < TOL


def test_path_through_wrong_tree_is_cut() -> None:
    """A path node from another tree (or not descending from the previous one) is not kept."""
    model = get_model("llama")
    rng = random.Random(6)
    roots = random_roots(rng, [5], [[True, True]])
    roots.tokens[0, 1] = roots.tokens[0, 0]  # identical roots: only the structure tells trees apart
    layers = [
        ForestLayer(torch.tensor([[0, 1]]), torch.tensor([[3, 3]]), torch.tensor([[True, True]])),
        ForestLayer(torch.tensor([[0, 1]]), torch.tensor([[7, 7]]), torch.tensor([[True, True]])),
    ]
    scorer = TransformerScorer(model)
    run_iteration(scorer, roots, layers, None, "target")
    # Beam claims root 0 but its layer-2 node (index 1) lives in tree 1: keep only layer 1.
    new_roots, origin = grow(roots, layers, [[(0, [0, 0], 2)]])
    origin.path[0, 0, 1] = 1
    scorer.set_roots(ForestRoots(new_roots.tokens, new_roots.lengths, new_roots.alive, origin))
    assert check_cache_matches_prefill(model, scorer, new_roots, [6]) < TOL
    out = scorer.forward([])
    assert check_forest(model, new_roots, [], out.roots, []) < TOL


def test_path_not_descending_from_previous_node_is_cut() -> None:
    """Path [A, child of B] in one tree: the tokens match but the KV of B's child saw B's token."""
    model = get_model("llama")
    rng = random.Random(7)
    roots = random_roots(rng, [5], [[True]])
    layers = [
        ForestLayer(torch.tensor([[0, 0]]), torch.tensor([[3, 4]]), torch.tensor([[True, True]])),
        ForestLayer(torch.tensor([[0, 1]]), torch.tensor([[7, 7]]), torch.tensor([[True, True]])),
    ]
    scorer = TransformerScorer(model)
    run_iteration(scorer, roots, layers, None, "target")
    new_roots, origin = grow(roots, layers, [[(0, [0, 0], 2)]])
    origin.path[0, 0, 1] = 1  # node 1 of layer 2 has token 7 too, but its parent is B (token 4)
    scorer.set_roots(ForestRoots(new_roots.tokens, new_roots.lengths, new_roots.alive, origin))
    assert check_cache_matches_prefill(model, scorer, new_roots, [6]) < TOL
    out = scorer.forward([])
    assert check_forest(model, new_roots, [], out.roots, []) < TOL


def test_same_roots_again_keep_all_but_last_token() -> None:
    """Re-sending the roots unchanged (empty path, no new token) must still yield root outputs."""
    model = get_model("qwen2")
    rng = random.Random(10)
    roots = random_roots(rng, [5, 7], [[True, True], [True, False]])
    layers = random_forest(rng, roots, depth=2, max_nodes=3)
    scorer = TransformerScorer(model)
    run_iteration(scorer, roots, layers, None, "target")
    origin = Origin(torch.tensor([[0, 1], [0, 0]]), torch.full((2, 2, 2), -1, dtype=torch.long))
    scorer.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, origin))
    assert check_cache_matches_prefill(model, scorer, roots, [4, 6]) < TOL
    out = scorer.forward(layers)
    assert check_forest(model, roots, layers, out.roots, out.layers) < TOL


def random_picks(
    rng: random.Random, roots: Roots, layers: list[ForestLayer]
) -> tuple[list[list[Pick]], list[int]]:
    """Random new beams: per session a random accepted depth and 0..4 beams (session 0 may die).

    Returns the picks and each session's accepted depth.
    """
    picks, depths = [], []
    for b in range(roots.alive.shape[0]):
        alive = roots.alive[b].nonzero().squeeze(1).tolist()
        depth = rng.randrange(len(layers) + 1)
        count = 0 if not alive else rng.choice([0, 1, 2, 3, 4] if b == 0 else [1, 2, 3, 4])
        session = []
        for _ in range(count):
            if depth == 0:
                session.append((rng.choice(alive), [], rng.randrange(VOCAB)))
            else:
                m = rng.choice(existing(layers[depth - 1], b))
                session.append(leaf_pick(layers, b, depth, m, rng.randrange(VOCAB)))
        picks.append(session)
        depths.append(depth)
    return picks, depths


@pytest.mark.parametrize("style", ["target", "draft"])
def test_several_iterations_stay_exact(style: str) -> None:
    model = get_model("qwen2")
    rng = random.Random(8)
    roots = random_roots(rng, [3, 6], [[True, False, True], [True, True, True]])
    scorer = TransformerScorer(model)
    depth = 3
    fed_depth = depth if style == "target" else depth - 1
    origin: Origin | None = None
    expect_kept = [0, 0]
    worst = 0.0
    for _ in range(5):
        scorer.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, origin))
        for b in range(2):  # compaction really reused the cache (no silent re-prefill)
            kept = expect_kept[b] if bool(roots.alive[b].any()) else 0
            assert scorer.session_cache(b)[1].shape[1] == kept
        live = int(roots.alive.any(dim=1).sum())
        calls = scorer.forward_calls
        layers = random_forest(rng, roots, depth=depth, max_nodes=4)
        root_lp, outs = feed(scorer, layers, style)
        per_session = 1 if style == "target" else depth
        # sessions share each forward; when every session is dead nothing runs at all
        assert scorer.forward_calls - calls == (per_session if live else 0)
        worst = max(worst, check_forest(model, roots, layers, root_lp, outs))
        picks, accepted = random_picks(rng, roots, layers)
        expect_kept = [int(roots.lengths[b]) + min(accepted[b], fed_depth) for b in range(2)]
        roots, origin = grow(roots, layers, picks)
    assert worst < TOL
    scorer.release()
    with pytest.raises(RuntimeError):
        scorer.forward([])


def test_dead_session_costs_nothing() -> None:
    model = get_model("llama")
    rng = random.Random(9)
    roots = random_roots(rng, [4, 5], [[True, True], [False, False]])
    layers = random_forest(rng, roots, depth=2, max_nodes=3)
    for layer in layers:
        layer.exists[1] = False
    scorer = TransformerScorer(model)
    scorer.set_roots(ForestRoots(roots.tokens, roots.lengths, roots.alive, None))
    out = scorer.forward(layers)
    assert scorer.forward_calls == 1
    assert torch.all(out.roots[1] == 0)
    assert check_forest(model, roots, layers, out.roots, out.layers) < TOL
    cache, columns = scorer.session_cache(1)
    assert cache is None and columns.numel() == 0
