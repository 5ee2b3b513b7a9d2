"""The prompt-lookup draft's distributions (issue 48, dsbd_core/algorithm/scorers/ngram_draft.py):
the followers of the longest earlier suffix, counted; no match, no children; a compact support of
the context's tokens padded with tokens of no mass."""

from __future__ import annotations

import pytest
import torch

from dsbd_core.algorithm.scorer import ForestLayer, Roots
from dsbd_core.algorithm.scorers.ngram_bounds import check_ngram_max
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft


def _roots(rows: list[list[int]], length: int) -> Roots:
    tokens = torch.tensor([[row + [0] * (12 - len(row)) for row in rows]])
    return Roots(tokens, torch.tensor([length]), torch.ones(1, len(rows), dtype=torch.bool), None)


def _as_dict(logq: torch.Tensor, support: torch.Tensor) -> dict[int, float]:
    q = logq.exp()
    return {int(t): round(float(p), 6) for t, p in zip(support, q, strict=True) if p > 0}


def test_the_longest_earlier_suffix_decides_and_its_followers_are_counted() -> None:
    draft = NgramDraft(10, ngram_max=3, min_support=1)
    # beam 0: suffix "2 1" never occurred before, "1" did three times, followed by 2 each time;
    # beam 1: suffix "6 7 8" occurred once, followed by 9
    draft.set_roots(_roots([[1, 2, 3, 1, 2, 4, 1, 2, 1], [5, 6, 7, 8, 9, 5, 6, 7, 8]], 9))
    out = draft.forward([])
    support = out.support
    # the context's tokens 1..9, padded to a power of two (16) but never past V = 10
    assert support is not None and support.tolist() == list(range(10))
    assert out.roots is not None
    assert _as_dict(out.roots[0, 0], support) == {2: 1.0}
    assert _as_dict(out.roots[0, 1], support) == {9: 1.0}
    # one layer: beam 0 + 2 ("1 2" occurred three times: 3, 4, 1 followed); beam 1 + 9
    layer = ForestLayer(torch.tensor([[0, 1]]), torch.tensor([[2, 9]]), torch.ones(1, 2).bool())
    nodes = draft.forward([layer]).layers[0][0]
    assert _as_dict(nodes[0], support) == {1: 0.333333, 3: 0.333333, 4: 0.333333}
    assert _as_dict(nodes[1], support) == {5: 1.0}
    assert draft.forward_calls == 2


def test_no_earlier_match_gives_no_children_and_the_support_is_padded() -> None:
    draft = NgramDraft(1000, ngram_max=2, min_support=4)
    draft.set_roots(_roots([[3, 5, 7]], 3))  # every token new: nothing to follow
    out = draft.forward([])
    assert out.support is not None and out.support.tolist() == [0, 3, 5, 7]  # 0: no mass
    assert out.roots is not None and bool(torch.isneginf(out.roots).all())
    wide = NgramDraft(1000)  # the default minimum: 256 columns
    wide.set_roots(_roots([[3, 5, 7]], 3))
    assert wide.forward([]).support.numel() == 256  # type: ignore[union-attr]
    small = NgramDraft(4)  # never wider than the vocabulary
    small.set_roots(_roots([[1, 2]], 2))
    assert small.forward([]).support.tolist() == [0, 1, 2, 3]  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [0, 17, -1, 2.5, True])
def test_a_bound_outside_its_range_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"ngram_max=.*allowed"):
        check_ngram_max(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed"):
        NgramDraft(10, bad)  # type: ignore[arg-type]
