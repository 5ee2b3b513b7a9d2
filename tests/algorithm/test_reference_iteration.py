"""The reading path decodes the served path's tokens: `dsbd_core/algorithm/reference.py` (one
session, plain loops) against the engine (`generate`, batched), draw for draw.

Both run seeded decodes on exact n-gram tables (`TableScorer`, float64) and must give the same
beams, the same log-likelihoods (to 1e-9) and, in every iteration, the same layers passed and
widths. The decodes fail layers, pass them, finish beams and refill emptied layers, so a draw the
reference took from another stream, in another shape or order, moves their tokens.
"""

from __future__ import annotations

from collections import Counter
from math import log
from typing import Any

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer, generate
from dsbd_core.algorithm.reference import Model, reference_decode
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from tests.support.exact_reference import random_table

EOS = 0
SEEDS = (0, 1, 4, 5)  # every case meets a failed layer with these draws
# (name, vocabulary, n-gram order, prompt, how close the draft is to the target): a wide trigram
# pair (the first layer's table, 3 x 24, is larger than what the distinct width estimate keeps
# exactly), a small bigram pair where EOS is likely (beams and accepted drafts finish, layers
# empty and are refilled), and a good draft (most layers pass: second and third acceptances,
# bonus layers, deep forests).
PAIRS = [
    ("trigram-24", 24, 3, [3, 5, 7], 0.0),
    ("bigram-5", 5, 2, [2], 0.0),
    ("close-bigram-8", 8, 2, [3], 0.8),
]
CASES: list[tuple[str, dict[str, Any]]] = [
    ("fixed-w3-g2", {"width": 3, "gamma": 2}),
    ("fixed-w2-g3-ws4", {"width": 2, "gamma": 3, "draft_width": 4}),
    ("fixed-w3-g1-repl", {"width": 3, "gamma": 1, "mode": "with_replacement"}),
    ("t0.7-w3-g3", {"width": 3, "gamma": 3, "threshold": 0.7}),
    ("t0.7-w3-g2-ws5", {"width": 3, "gamma": 2, "draft_width": 5, "threshold": 0.7}),
    ("t0.7-w2-g3-repl", {"width": 2, "gamma": 3, "threshold": 0.7, "mode": "with_replacement"}),
    (
        "t0.5-w3-g2-ws4-repl",
        {"width": 3, "gamma": 2, "draft_width": 4, "threshold": 0.5, "mode": "with_replacement"},
    ),
    ("t0.9-wmin2", {"width": 3, "gamma": 2, "threshold": 0.9, "w_min": 2}),
    ("filtered", {"width": 3, "gamma": 2, "threshold": 0.7, "temperature": 0.8, "top_p": 0.9}),
    ("top-k", {"width": 2, "gamma": 2, "top_k": 6}),
    ("lean", {"width": 3, "gamma": 3, "threshold": 0.7, "lean_memory": True}),
    ("epsilon", {"width": 3, "gamma": 2, "epsilon": 0.1}),
]


def _params() -> list[Any]:
    """Every case on every pair; dynamic width with distinct drafts on the wide pair is `slow`
    (its width estimate simulates 256 layers per verified layer: 1.5-2 s per case)."""
    params = []
    for pair in PAIRS:
        for name, fields in CASES:
            estimated = fields.get("threshold") is not None and "mode" not in fields
            marks = [pytest.mark.slow] if estimated and pair[1] > 10 else []
            params.append(pytest.param(*pair, name, fields, id=f"{name}-{pair[0]}", marks=marks))
    return params


def _pair(vocab: int, order: int, close: float) -> tuple[np.ndarray, np.ndarray]:
    """A target table and a draft table: a different one (with exact zeros where the target has
    mass), mixed with the target itself in proportion `close` (a good draft: layers pass)."""
    rng = np.random.default_rng(vocab)
    target = random_table(rng, vocab, order, concentration=0.5)
    other = random_table(rng, vocab, order, concentration=0.5, zero_prob=0.2)
    if close == 0.0:
        return target, other
    return target, np.log(close * np.exp(target) + (1.0 - close) * np.exp(other))


def _model(table: np.ndarray) -> Model:
    """The table as the reference's model: the same float64 rows `TableScorer` looks up."""
    rows, order, vocab = TableScorer(torch.from_numpy(table)).rows, table.ndim, table.shape[-1]

    def next_logprobs(tokens: list[int]) -> torch.Tensor:
        context = 0
        for token in tokens[len(tokens) - (order - 1) :]:
            context = context * vocab + token
        return rows[context]

    return next_logprobs


def _lookup_model(vocab: int, ngram_max: int) -> Model:
    """The prompt-lookup draft written plainly (issue 48; `NgramDraft` is the engine's): the
    followers of the longest suffix (n <= ngram_max) that occurred before, counted, over the
    whole vocabulary; -inf everywhere where nothing matches."""

    def next_logprobs(tokens: list[int]) -> torch.Tensor:
        out = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        for n in range(min(ngram_max, len(tokens) - 1), 0, -1):
            suffix = tokens[len(tokens) - n :]
            followers = Counter(
                tokens[j + 1]
                for j in range(n - 1, len(tokens) - 1)
                if tokens[j - n + 1 : j + 1] == suffix
            )
            if followers:
                total = sum(followers.values())
                for token, count in followers.items():
                    out[token] = log(count / total)
                return out
        return out

    return next_logprobs


def _compare(
    target: np.ndarray,
    draft: Model,
    draft_scorer: Any,
    prompt: list[int],
    fields: dict[str, Any],
    where: str,
) -> Counter[str]:
    """Decode with every seed in the engine and in the reference; the same layers passed,
    widths, beams and log-likelihoods. Returns what the decodes met."""
    seen: Counter[str] = Counter()
    vocab = target.shape[-1]
    for seed in SEEDS:
        config = SamplingConfig(max_new_tokens=12, eos_token_ids=(EOS,), seed=seed, **fields)
        engine = generate(
            "dsbd", TableScorer(torch.from_numpy(target)), prompt, config, draft_scorer()
        )
        session = reference_decode(prompt, _model(target), draft, config, vocab)
        at = f"{where}/seed{seed}"
        assert [passed for passed, _ in session.history] == engine.stats.accepted_layers, at
        assert [widths for _, widths in session.history] == engine.stats.widths, at
        start = len(prompt)
        got = sorted((b.tokens[start:], f, b.score) for b, f in session.pool)
        expected = sorted((b.token_ids, b.finished, b.log_likelihood) for b in engine.beams)
        assert [g[:2] for g in got] == [e[:2] for e in expected], at
        for (_, _, score), (_, _, want) in zip(got, expected, strict=True):
            assert score == pytest.approx(want, abs=1e-9), at
        history = zip(engine.stats.accepted_layers, engine.stats.widths, strict=True)
        seen["iterations"] += len(engine.stats.accepted_layers)
        seen["failed layers"] += sum(layers < len(verified) for layers, verified in history)
        seen["passed layers"] += sum(engine.stats.accepted_layers)
    return seen


@pytest.mark.parametrize(("pair", "vocab", "order", "prompt", "close", "name", "fields"), _params())
def test_the_reference_decodes_the_engines_tokens(
    pair: str,
    vocab: int,
    order: int,
    prompt: list[int],
    close: float,
    name: str,
    fields: dict[str, Any],
) -> None:
    target, draft = _pair(vocab, order, close)
    draft_table = torch.from_numpy(draft)
    where = f"{pair}/{name}"
    seen = _compare(target, _model(draft), lambda: TableScorer(draft_table), prompt, fields, where)
    # the decodes reach the branches the comparison is for
    assert seen["iterations"] >= 2 * len(SEEDS) and seen["failed layers"] > 0, seen


# (pair, prompt, min_support): prompts that repeat, so that the look-up matches at once and
# keeps matching; a support of the context's tokens padded to a power of two (min_support 1:
# 3 tokens + 1 of no mass), or the whole vocabulary (the default minimum, 256 > V)
NGRAM_PAIRS = [("bigram-5", [2, 3, 2, 4, 2], 1), ("close-bigram-8", [3, 1, 3, 1, 3], 256)]


@pytest.mark.parametrize(("name", "fields"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(
    ("pair", "prompt", "min_support"), NGRAM_PAIRS, ids=[p[0] for p in NGRAM_PAIRS]
)
def test_the_reference_decodes_the_engines_tokens_with_the_ngram_draft(
    pair: str, prompt: list[int], min_support: int, name: str, fields: dict[str, Any]
) -> None:
    """The prompt-lookup draft (issue 48) in every case, dynamic width and lean memory too:
    its compact support draws what the plain look-up's vocabulary-wide rows draw."""
    _, vocab, order, _, close = next(p for p in PAIRS if p[0] == pair)
    target, _ = _pair(vocab, order, close)
    draft = _lookup_model(vocab, 2)
    seen = _compare(
        target,
        draft,
        lambda: NgramDraft(vocab, 2, min_support=min_support),
        prompt,
        fields,
        f"{pair}/{name}",
    )
    assert seen["iterations"] >= 2 * len(SEEDS) and seen["failed layers"] > 0, seen
