"""The static path's forwards inside a side's graph (`static_side.py`): a real model's DSBD
iteration is two graph calls, and it decodes the eager path's tokens.

CPU-side evidence (the CPU takes a device's branches, `computing_everywhere`; graphs on the
`eager` backend): a tiny Llama in float64 behind `StaticScorer`, `Decode(graph=True)` against
`Decode(graph=False)`. The eager decode runs the same slot layout, bucket and step bucket by
bucket, so tokens, log-likelihoods and statistics are equal bit for bit. Per steady-state
iteration the host makes 2 compiled calls, and outside them the engine makes at most 20
operations and 1 read; the scorer's work around its graphs is left out of those counts
(`prepare_side`: the compaction in the pool from the host's copies of the roots and one copy of
the side's metadata to the device; `finish_side`: bookkeeping on host numbers).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

from dsbd_core import SamplingConfig
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.drivers.loop import Decode, Propose, run_decode
from dsbd_core.algorithm.methods import method_config
from dsbd_core.models.static_scorer import StaticScorer
from tests.support.host_work import Ops, counting
from tests.support.tiny_models import VOCAB, tiny

PROMPTS = [[1, 2, 3, 4], [8, 9, 10, 11, 12, 13]]
CASES = [
    ("dsbd", {"width": 3, "gamma": 3, "threshold": None}),
    ("beam", {"width": 3}),
    ("spec_beam_search", {"width": 3, "gamma": 2}),  # the search engine's sides
]


def _config(method: str, fields: dict) -> Any:
    config = SamplingConfig(max_new_tokens=10, eos_token_ids=(0,), seed=1, **fields)
    return method_config(method, config)


def _scorer_work(ops: Ops, work: collections.Counter) -> list[tuple[str, Any]]:
    """Wrap the scorer's work around its graphs: its operations and reads are left out of the
    engine's (`ops`, the reads), its calls counted in `work`. Returns what to restore."""
    saved = [(name, getattr(StaticScorer, name)) for name in ("prepare_side", "finish_side")]

    def wrapped(name: str, original: Any) -> Any:
        def run(self: StaticScorer, *args: Any) -> Any:
            work[name] += 1
            paused, ops.paused = ops.paused, True
            try:
                return original(self, *args)
            finally:
                ops.paused = paused

        return run

    for name, original in saved:
        setattr(StaticScorer, name, wrapped(name, original))
    return saved


@pytest.mark.slow
@pytest.mark.parametrize(("method", "fields"), CASES, ids=[c[0] for c in CASES])
def test_a_real_model_inside_the_side_graphs_decodes_the_eager_tokens(
    method: str, fields: dict
) -> None:
    target, draft = tiny("llama", 1), tiny("llama", 2)
    config = _config(method, fields)

    def decode(graph: bool) -> tuple[list, tuple[int, int]]:
        scorers = StaticScorer(target), StaticScorer(draft)
        run = Decode(config, VOCAB, PROMPTS, graph=graph)
        results = run_decode(run, scorers[0], scorers[1] if config.uses_draft else None)
        return results, (scorers[0].forward_calls, scorers[1].forward_calls)

    with computing_everywhere():
        eager, eager_calls = decode(False)
        graphed, graphed_calls = decode(True)
    for a, b in zip(eager, graphed, strict=True):
        assert [(x.token_ids, x.log_likelihood, x.finished) for x in a.beams] == [
            (x.token_ids, x.log_likelihood, x.finished) for x in b.beams
        ]
        assert a.stats.as_dict() == b.stats.as_dict()
    assert graphed_calls == eager_calls  # the forwards inside the graphs are counted

    scorers = StaticScorer(target), StaticScorer(draft)
    run = Decode(config, VOCAB, PROMPTS, graph=True)
    steps, answer, counted = run.steps(), None, 0
    with computing_everywhere():
        while True:
            ops, calls, reads = Ops(), collections.Counter(), collections.Counter()
            work: collections.Counter = collections.Counter()
            with counting(ops, calls, reads):
                saved = _scorer_work(ops, work)
                try:
                    try:
                        call = steps.send(answer)
                    except StopIteration:
                        break
                    iteration = run.state.iteration
                    planned = run.state.planned
                    full = planned is not None and planned[1] == config.gamma
                    if isinstance(call, Propose):
                        answer = call.call.propose(scorers[1], VOCAB)
                        call = steps.send(answer)
                    answer = call.call.verify(scorers[0], VOCAB, call.forest)
                finally:
                    for name, original in saved:
                        setattr(StaticScorer, name, original)
            if iteration <= 1 or calls.pop("retired", 0) or (config.uses_draft and not full):
                # the prefill and the next plan; a session retiring its beams (eagerly); the
                # budget's last, shallower iterations (another shape)
                continue
            counted += 1
            assert (
                calls == {"draft_side": 1, "verify_side": 1}
                if config.uses_draft
                else {"verify_side": 1}
            ), (iteration, dict(calls))
            sides = 2 if config.uses_draft else 1
            assert work == {"prepare_side": sides, "finish_side": sides}, dict(work)
            assert ops.count <= 20, (iteration, ops.count)
            assert sum(reads.values()) == 1, (iteration, dict(reads))
    assert counted >= 2, "no steady-state iteration was counted"
