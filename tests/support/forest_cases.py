"""Shared cases of the TransformerScorer tests: tiny models, random forests, exact references.

Every check compares with the model run without any cache on the node's (or beam's) full token
sequence (ALGORITHM.md §12.3 items 12 and 13), on tiny random float64 Llama / Qwen2 models, so the
only tolerated difference is floating-point reordering (< 1e-6; measured ~1e-15 for sdpa, ~3e-8 for
eager, whose softmax runs in float32 even for a float64 model).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dsbd_core.algorithm.scorer import ForestLayer

from . import tiny_models

VOCAB = 16
TOL = 1e-6


def tiny_model(arch: str, attn: str) -> torch.nn.Module:
    """A 2-layer random float64 causal LM with grouped-query attention (4 heads, 2 KV heads)."""
    model = tiny_models.tiny_model(
        VOCAB, arch=arch, seed=1234, positions=256, attn_implementation=attn
    )
    return model.to(torch.float64)


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def get_model(arch: str, attn: str = "sdpa") -> torch.nn.Module:
    key = (arch, attn)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(arch, attn)
    return _MODELS[key]


MODELS = [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")]

# ----------------------------------------------------------------------------- forest helpers


@dataclass
class Roots:
    tokens: torch.Tensor  # [B, R, L]
    lengths: torch.Tensor  # [B]
    alive: torch.Tensor  # [B, R]


Pick = tuple[int, list[int], int]  # (old root, path nodes at layers 1..d, new token)


def random_roots(rng: random.Random, lengths: list[int], alive: list[list[bool]]) -> Roots:
    """Random beams; padding (dead rows, columns past the length) filled with random tokens."""
    batch, root_count = len(alive), len(alive[0])
    width = max(lengths) + 2
    tokens = torch.tensor(
        [
            [[rng.randrange(VOCAB) for _ in range(width)] for _ in range(root_count)]
            for _ in range(batch)
        ]
    )
    return Roots(tokens, torch.tensor(lengths), torch.tensor(alive))


def random_forest(
    rng: random.Random, roots: Roots, depth: int, max_nodes: int
) -> list[ForestLayer]:
    """Uneven random trees: each layer has up to `max_nodes` nodes per session, with padding.

    Node 0 of every layer exists (so every layer, the last one included, has a real node);
    each existing node picks a random existing parent, so some trees get many nodes, others
    none (rows are padded to the longest tree).
    """
    batch = roots.alive.shape[0]
    layers = []
    previous_exists = roots.alive.tolist()
    for _ in range(depth):
        m = max_nodes
        parent = torch.zeros(batch, m, dtype=torch.long)
        token = torch.zeros(batch, m, dtype=torch.long)
        exists = torch.zeros(batch, m, dtype=torch.bool)
        for b in range(batch):
            candidates = [i for i, e in enumerate(previous_exists[b]) if e]
            for j in range(m):
                real = j == 0 or rng.random() < 0.7
                token[b, j] = rng.randrange(VOCAB)
                if real and candidates:
                    parent[b, j] = rng.choice(candidates)
                    exists[b, j] = True
                else:  # padding: arbitrary valid parent index
                    parent[b, j] = rng.randrange(len(previous_exists[b]))
        layers.append(ForestLayer(parent=parent, token=token, exists=exists))
        previous_exists = exists.tolist()
    return layers


def node_path(layers: list[ForestLayer], b: int, depth: int, m: int) -> tuple[int, list[int]]:
    """(root index, node index at layers 1..depth) of node m at layer `depth` (1-based)."""
    path = [m]
    for layer in range(depth - 1, 0, -1):
        path.append(int(layers[layer].parent[b, path[-1]]))
    root = int(layers[0].parent[b, path[-1]])
    return root, path[::-1]


def node_sequence(roots: Roots, layers: list[ForestLayer], b: int, depth: int, m: int) -> list[int]:
    """The full token sequence ending at node m of layer `depth` (1-based)."""
    root, path = node_path(layers, b, depth, m)
    prefix = roots.tokens[b, root, : int(roots.lengths[b])].tolist()
    return prefix + [int(layers[i].token[b, node]) for i, node in enumerate(path)]


def reference(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    """Next-token log-probs after `sequence`, model run once without any cache."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([sequence])).logits[0, -1]
    return logits.to(torch.float64).log_softmax(-1)


def check_forest(
    model: torch.nn.Module,
    roots: Roots,
    layers: list[ForestLayer],
    root_logprobs: torch.Tensor | None,
    layer_logprobs: list[torch.Tensor],
    first_layer: int = 1,
) -> float:
    """Max abs diff of every real root / node output against its no-cache reference."""
    worst = 0.0
    batch, root_count = roots.alive.shape
    for b in range(batch):
        if root_logprobs is not None:
            for r in range(root_count):
                if roots.alive[b, r]:
                    seq = roots.tokens[b, r, : int(roots.lengths[b])].tolist()
                    diff = (root_logprobs[b, r] - reference(model, seq)).abs().max()
                    worst = max(worst, float(diff))
        for offset, out in enumerate(layer_logprobs):
            depth = first_layer + offset
            for m in range(out.shape[1]):
                if layers[depth - 1].exists[b, m]:
                    seq = node_sequence(roots, layers, b, depth, m)
                    worst = max(worst, float((out[b, m] - reference(model, seq)).abs().max()))
    return worst


def standard_case(seed: int) -> tuple[Roots, list[ForestLayer]]:
    """B=2 sessions of different lengths, dead rows, 3 uneven layers of up to 5 nodes."""
    rng = random.Random(seed)
    roots = random_roots(rng, [5, 8], [[True, False, True], [True, True, False]])
    return roots, random_forest(rng, roots, depth=3, max_nodes=5)
