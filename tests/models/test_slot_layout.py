"""The forest laid out on the model's device (`slot_layout`): the static path's forwards read no
value of the engine's tensors, so a DSBD iteration waits once (the engine's planning read), and
they decode the host layout's tokens.

CPU-side evidence: `computing_everywhere()` makes the CPU take a device's branches, the static
scorer's included; every host read made inside a scorer's `forward` is counted (on a GPU each
would wait for the device).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from dsbd_core import SamplingConfig, generate_batch
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.models import static_scorer
from dsbd_core.models.static_scorer import StaticScorer
from tests.support.tiny_models import tiny

READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")
PROMPTS = [[1, 2, 3, 4], [5, 6], [8, 9, 10, 11, 12, 13]]
CASES = [
    ("dsbd", {"width": 3, "gamma": 3, "threshold": None}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": 0.7, "draft_width": 4}),
    ("sps", {"gamma": 3}),
    ("spec_beam_search", {"width": 3, "gamma": 2}),
]


@contextmanager
def counting(counts: collections.Counter) -> Iterator[None]:
    """Count host reads made inside `StaticScorer.forward` calls with layers (the engine's
    drafts), and the sessions that had to be prefilled again instead of compacted."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    inside = [False]

    def wrap(name: str):  # noqa: ANN202
        def read(self: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if inside[0]:
                counts["reads"] += 1
            return saved[name](self, *args, **kwargs)

        return read

    forward, plan = StaticScorer.forward, static_scorer.plan_compaction

    def counted_forward(self, layers):  # noqa: ANN001, ANN202
        inside[0] = bool(layers)  # a call without layers is planned from the roots' host copy
        try:
            counts["forwards"] += inside[0]
            return forward(self, layers)
        finally:
            inside[0] = False

    def counted_plan(*args):  # noqa: ANN002, ANN202
        kept = plan(*args)
        counts["compacted" if kept is not None else "prefilled"] += 1
        return kept

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        StaticScorer.forward = counted_forward  # type: ignore[method-assign]
        static_scorer.plan_compaction = counted_plan
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        StaticScorer.forward = forward  # type: ignore[method-assign]
        static_scorer.plan_compaction = plan


@pytest.mark.slow
@pytest.mark.parametrize(("method", "fields"), CASES)
def test_the_device_layout_reads_nothing_compacts_and_decodes_the_host_tokens(
    method: str, fields: dict
) -> None:
    target, draft = tiny("llama", 1), tiny("llama", 2)
    config = SamplingConfig(max_new_tokens=16, eos_token_ids=(0,), seed=1, **fields)
    host = generate_batch(method, StaticScorer(target), PROMPTS, config, StaticScorer(draft))
    counts: collections.Counter = collections.Counter()
    with computing_everywhere(), counting(counts):
        device = generate_batch(method, StaticScorer(target), PROMPTS, config, StaticScorer(draft))
    assert counts["forwards"] > 10 and counts["reads"] == 0, counts
    assert counts["compacted"] > 0 and counts["prefilled"] == 0, counts
    for got, want in zip(device, host, strict=True):
        assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
        assert [b.log_likelihood for b in got.beams] == [b.log_likelihood for b in want.beams]
        assert got.stats == want.stats


@pytest.mark.slow
def test_continuous_batching_keeps_the_host_tokens_in_the_device_layout() -> None:
    """Sessions joining and leaving one pool (`SessionBatcher`, lockstep): the same tokens."""
    target, draft = tiny("llama", 1), tiny("llama", 2)
    requests = [
        Request(
            PROMPTS[i % 3],
            SamplingConfig(max_new_tokens=6 + 3 * i, eos_token_ids=(0,), seed=i, **fields),
            method,
        )
        for i, (method, fields) in enumerate(CASES)
    ]

    def decode() -> list:
        results, _ = decode_lockstep(
            requests, SessionBatcher(StaticScorer(target)), SessionBatcher(StaticScorer(draft))
        )
        assert all(r.error is None for r in results)
        return [[b.token_ids for b in r.result.beams] for r in results]

    host = decode()
    counts: collections.Counter = collections.Counter()
    with computing_everywhere(), counting(counts):
        device = decode()
    assert device == host
    assert counts["reads"] == 0 and counts["prefilled"] == 0, counts
