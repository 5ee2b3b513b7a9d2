"""Batching concurrent requests into one model forward (what the serving replicas do).

Requests with different configs (width, depth, draft width, mode, dynamic/fixed width) are
decoded together: each iteration, every live request's draft side runs in one `SessionBatcher`
batch on the draft model and its target side in one batch on the target. Every request must
decode exactly what it decodes alone in-process, with one forward per lockstep round, caches
keyed by session id, and a re-prefill (not a wrong answer) when a cache is missing.
"""

from __future__ import annotations

import pytest
import torch

from dsbd_core import SamplingConfig, generate
from dsbd_core.algorithm.drivers.session_batch import Job, SessionBatcher
from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.sequences.state import NO_FOREST
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import VOCAB, tiny

REQUESTS = [
    ([1, 2, 3, 4], {"width": 3, "gamma": 3, "threshold": 0.6, "seed": 1}),
    (
        [5, 6],
        {
            "width": 2,
            "draft_width": 4,
            "gamma": 2,
            "threshold": None,
            "seed": 2,
            "mode": "with_replacement",
        },
    ),
    ([7], {"width": 1, "gamma": 4, "threshold": None, "seed": 3}),
    ([8, 9, 10, 11, 12, 13], {"width": 3, "gamma": 1, "lean_memory": True, "seed": 4}),
]


def configs() -> list[SamplingConfig]:
    return [SamplingConfig(max_new_tokens=9, eos_token_ids=(0,), **x) for _, x in REQUESTS]


def decode_together(
    draft: SessionBatcher, target: SessionBatcher, evict_every: int = 0
) -> tuple[list, list]:
    """A router's loop for all REQUESTS at once; returns results and the batch reports."""
    engines = [Engine(method_config("dsbd", cfg), VOCAB) for cfg in configs()]
    states = [e.start([prompt]) for e, (prompt, _) in zip(engines, REQUESTS, strict=True)]
    reports = []
    iteration = 0
    while True:
        live = [
            i for i, (e, s) in enumerate(zip(engines, states, strict=True)) if e.next_iteration(s)
        ]
        if not live:
            break
        iteration += 1
        if evict_every and iteration % evict_every == 0:
            for i in live:  # as if the session moved to a replica that never saw it
                draft.release(f"r{i}")
                target.release(f"r{i}")
        messages = {i: states[i].for_models() for i in live}
        forests, report = draft.run(
            [Job(f"r{i}", engines[i].propose_steps(messages[i])) for i in live]
        )
        reports.append(("draft", report))
        outcomes, report = target.run(
            [
                Job(f"r{i}", engines[i].verify_steps(messages[i], f))
                for i, f in zip(live, forests, strict=True)
            ]
        )
        reports.append(("target", report))
        for i, outcome in zip(live, outcomes, strict=True):
            assert not isinstance(outcome, BaseException), outcome
            engines[i].advance(states[i], outcome)
    return [e.finish(s)[0] for e, s in zip(engines, states, strict=True)], reports


def alone() -> list:
    target_model, draft_model = tiny("llama", 1), tiny("llama", 2)
    out = []
    for (prompt, _), cfg in zip(REQUESTS, configs(), strict=True):
        out.append(
            generate(
                "dsbd", TransformerScorer(target_model), prompt, cfg, TransformerScorer(draft_model)
            )
        )
    return out


def assert_same(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert [x.token_ids for x in a.beams] == [x.token_ids for x in b.beams]
        for x, y in zip(a.beams, b.beams, strict=True):
            assert abs(x.log_likelihood - y.log_likelihood) < 1e-9
        assert a.stats.as_dict() == b.stats.as_dict()


@pytest.mark.slow
def test_batched_requests_decode_what_each_decodes_alone() -> None:
    target = TransformerScorer(tiny("llama", 1))
    draft = TransformerScorer(tiny("llama", 2))
    got, reports = decode_together(SessionBatcher(draft), SessionBatcher(target))
    assert_same(got, alone())
    verify_reports = [r for side, r in reports if side == "target"]
    # one target forward per iteration for ALL live requests together
    assert all(r.forwards == 1 for r in verify_reports)
    assert target.forward_calls == len(verify_reports)
    assert verify_reports[0].requests == len(REQUESTS)
    # the draft: one forward per lockstep round = the deepest request's depth
    draft_reports = [r for side, r in reports if side == "draft"]
    assert draft_reports[0].forwards == max(x["gamma"] for _, x in REQUESTS)
    # caches were found from the second iteration on
    assert verify_reports[0].reused == 0 and verify_reports[1].reused == verify_reports[1].requests


@pytest.mark.slow
def test_missing_caches_reprefill_and_still_decode_the_same() -> None:
    target = SessionBatcher(TransformerScorer(tiny("llama", 1)))
    draft = SessionBatcher(TransformerScorer(tiny("llama", 2)))
    got, reports = decode_together(draft, target, evict_every=2)
    assert_same(got, alone())
    assert any(r.reused == 0 for side, r in reports[2:] if side == "target")


def test_sessions_are_freed_by_release_ttl_and_capacity() -> None:
    now = [0.0]
    batcher = SessionBatcher(
        TransformerScorer(tiny("llama", 1)), ttl_s=10.0, max_sessions=2, clock=lambda: now[0]
    )
    cfg = SamplingConfig(width=2, max_new_tokens=4, seed=0)

    def one_iteration(key: str) -> None:
        engine = Engine(method_config("beam", cfg), VOCAB)
        state = engine.start([[1, 2, 3]])
        assert engine.next_iteration(state)
        (outcome,), _ = batcher.run([Job(key, engine.verify_steps(state, NO_FOREST))])
        assert not isinstance(outcome, BaseException)

    one_iteration("a")
    now[0] = 5.0
    one_iteration("b")
    assert batcher.cached == ["a", "b"]
    assert batcher.release("a") and not batcher.release("a")
    one_iteration("a")
    one_iteration("c")  # over capacity: the least recently used ("b") goes
    assert batcher.cached == ["a", "c"]
    now[0] = 100.0
    assert sorted(batcher.expire()) == ["a", "c"] and batcher.cached == []


def test_a_failing_request_fails_alone() -> None:
    batcher = SessionBatcher(TransformerScorer(tiny("llama", 1)))
    cfg = SamplingConfig(width=2, max_new_tokens=4, seed=0)

    def broken():
        raise ValueError("bad request")
        yield  # pragma: no cover

    engine = Engine(method_config("beam", cfg), VOCAB)
    state = engine.start([[1, 2, 3]])
    engine.next_iteration(state)
    good = Job("good", engine.verify_steps(state, NO_FOREST))
    results, report = batcher.run([Job("bad", broken()), good])
    assert isinstance(results[0], ValueError)
    assert not isinstance(results[1], BaseException)
    assert report.requests == 1 and batcher.cached == ["good"]
    assert torch.is_tensor(results[1].tokens)
