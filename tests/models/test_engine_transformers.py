"""The engine on real transformers models with KV caches equals the engine on a cache-free
reference scorer, draw for draw (same seed), over many iterations: cache compaction through
`Origin` is transparent to decoding. Tiny Llama/Qwen2 models in float64, built here."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from dsbd_core import ForestLayer, ForestLogprobs, SamplingConfig, generate_batch
from dsbd_core.algorithm.scorer import Roots
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import VOCAB, tiny


class RecomputeScorer:
    """Reference scorer: every root and node is scored by running the model on its whole
    sequence, without any cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.sequences: list[list[list[int] | None]] = []
        self.pending = False

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def set_roots(self, roots: Roots) -> None:
        tokens, lengths, alive = roots.tokens, roots.lengths, roots.alive
        self.sequences = [
            [
                tokens[b, r, : lengths[b]].tolist() if alive[b, r] else None
                for r in range(tokens.shape[1])
            ]
            for b in range(tokens.shape[0])
        ]
        self.roots = self.sequences
        self.pending = True

    def _score(self, rows: list[list[list[int] | None]]) -> torch.Tensor:
        out = torch.zeros(len(rows), len(rows[0]), VOCAB, dtype=torch.float64)
        for b, row in enumerate(rows):
            for j, seq in enumerate(row):
                if seq is not None:
                    with torch.no_grad():
                        logits = self.model(torch.tensor([seq])).logits[0, -1]
                    out[b, j] = torch.log_softmax(logits, -1)
        return out

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        roots = self._score(self.roots) if self.pending else None
        self.pending = False
        out = []
        for layer in layers:
            parents = self.sequences
            self.sequences = [
                [
                    parents[b][p] + [t] if e and parents[b][p] is not None else None
                    for p, t, e in zip(
                        layer.parent[b].tolist(),
                        layer.token[b].tolist(),
                        layer.exists[b].tolist(),
                        strict=True,
                    )
                ]
                for b in range(layer.parent.shape[0])
            ]
            out.append(self._score(self.sequences))
        return ForestLogprobs(roots=roots, layers=out)

    def release(self) -> None:
        self.sequences = []


CASES = [
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.6, "mode": "distinct"}),
    (
        "dsbd",
        {"width": 2, "draft_width": 4, "gamma": 2, "threshold": None, "mode": "with_replacement"},
    ),
    ("dsbd", {"width": 3, "gamma": 3, "lean_memory": True}),
    ("beam", {"width": 3}),
    ("sps", {"gamma": 4}),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("method", "extra"), CASES)
def test_cached_decoding_equals_cache_free_decoding(arch: str, method: str, extra: dict) -> None:
    target_model, draft_model = tiny(arch, 1), tiny(arch, 2)
    prompts = [[1, 2, 3, 4], [5, 6], [7], [8, 9, 10, 11, 12, 13]]  # ragged, finish apart
    cfg = SamplingConfig(max_new_tokens=10, eos_token_ids=(0,), seed=7, **extra)
    cached_target = TransformerScorer(target_model)
    cached = generate_batch(method, cached_target, prompts, cfg, TransformerScorer(draft_model))
    reference = generate_batch(
        method, RecomputeScorer(target_model), prompts, cfg, RecomputeScorer(draft_model)
    )
    for got, want in zip(cached, reference, strict=True):
        assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
        for a, b in zip(got.beams, want.beams, strict=True):
            assert abs(a.log_likelihood - b.log_likelihood) < 1e-9
        assert got.stats.as_dict() == want.stats.as_dict()
    # one target forward per iteration, shared by every live session of the batch
    assert cached_target.forward_calls == max(r.stats.target_forward_passes for r in cached)
