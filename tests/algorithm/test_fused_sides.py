"""A side whose model reads nothing runs whole as one graph: two graph calls and one read per
iteration (CPU-side evidence for the captured iteration of docs/ARCHITECTURE.md).

With a `GraphScorer` (the exact n-gram table) and the engine on a device (the CPU takes the
device's branches, `computing_everywhere`), `Decode(graph=True)` runs past its prefill each
iteration's draft side (the gamma draft layers unrolled, the draft's forwards between them) as
one compiled call and its verify side (the forest forward, verification, the next beams and the
next iteration's plan, packed for the host) as another, with `torch.compile(fullgraph=True)`:
a read of a value inside either is a graph break, and `fullgraph=True` makes it an error. The
tokens and statistics are the eager decode's, for both engines (sampling; beam search, its
speculative form and beam sampling under transformers' law on the search engine's fixed-shape
steps); per steady-state iteration the host makes at most
2 compiled calls, at most 20 tensor operations outside them and exactly 1 read (an iteration
where a session's budget runs out retires its beams eagerly: once a session).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.drivers.loop import Decode, Propose, run_decode
from dsbd_core.algorithm.methods import method_config
from tests.support.exact_reference import random_table
from tests.support.host_work import Ops, counting

VOCAB, EOS = 12, 0
PROMPTS = [[3, 5, 7], [1, 2], [9, 4, 4, 8]]
CASES = [
    ("dsbd-fixed", "dsbd", {"width": 3, "gamma": 3}),
    ("dsbd-dynamic", "dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
    ("beam", "beam", {"width": 3}),
    # the search engine's sides: beam search, its speculative form, transformers' law
    ("beam-search", "beam_search", {"width": 3}),
    ("spec-beam-search", "spec_beam_search", {"width": 3, "gamma": 3}),
    ("beam-transformers-law", "beam", {"width": 3, "selection": "transformers"}),
]


def _pair() -> tuple[TableScorer, TableScorer]:
    rng = np.random.default_rng(3)
    target = TableScorer(torch.from_numpy(random_table(rng, VOCAB, 3, concentration=0.5)))
    draft = TableScorer(torch.from_numpy(random_table(rng, VOCAB, 3, concentration=0.5)))
    return target, draft


def _config(method: str, fields: dict, tokens: int) -> Any:
    config = SamplingConfig(
        **{"max_new_tokens": tokens, "seed": 2, "eos_token_ids": (EOS,)} | fields
    )
    return method_config(method, config)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "method", "fields"), CASES, ids=[c[0] for c in CASES])
def test_a_fused_decode_gives_the_eager_tokens_in_two_graph_calls_and_one_read(
    name: str, method: str, fields: dict
) -> None:
    target, draft = _pair()
    drafts = method not in ("beam", "beam_search")
    config = _config(method, fields, 16)

    def decode(graphed: bool) -> list:
        run = Decode(config, VOCAB, PROMPTS, graph=graphed)
        return run_decode(run, target, draft if drafts else None)

    with computing_everywhere():
        eager = decode(False)
        forwards = (target.forward_calls, draft.forward_calls)
        graphed = decode(True)
    for a, b in zip(eager, graphed, strict=True):
        assert [(x.token_ids, x.log_likelihood, x.finished) for x in a.beams] == [
            (x.token_ids, x.log_likelihood, x.finished) for x in b.beams
        ], name
        assert a.stats.as_dict() == b.stats.as_dict(), name
    # the models' forwards are counted on the host, outside the graphs
    assert (target.forward_calls, draft.forward_calls) == tuple(2 * f for f in forwards)

    # per iteration past the prefill, at full depth: what the host does
    run = Decode(config, VOCAB, PROMPTS, graph=True)
    steps, answer, counted = run.steps(), None, 0
    with computing_everywhere():
        while True:
            ops, calls, reads = Ops(), collections.Counter(), collections.Counter()
            with counting(ops, calls, reads):
                try:
                    call = steps.send(answer)  # plans the iteration (the one read)
                except StopIteration:
                    break
                iteration = run.state.iteration
                full = drafts and run.state.planned is not None and run.state.planned[1] == 3
                if isinstance(call, Propose):
                    answer = call.call.propose(draft, VOCAB)
                    call = steps.send(answer)
                answer = call.call.verify(target, VOCAB, call.forest)
            if iteration <= 1 or (drafts and not full) or calls.pop("retired", 0):
                # the prefill runs eagerly, and so is the next iteration planned; a shallower
                # bucket (the budget's last tokens) is another shape; a session whose budget
                # ran out retires its beams eagerly (once a session)
                continue
            counted += 1
            assert sum(calls.values()) <= 2, (name, iteration, dict(calls))
            assert set(calls) <= {"draft_side", "verify_side"}, dict(calls)
            assert ops.count <= 20, (name, iteration, ops.count)
            # the advance of the previous iteration runs inside `send`: counted above too
            assert sum(reads.values()) == 1, (name, iteration, dict(reads))
    assert counted >= 2, "no steady-state iteration was counted"


def test_a_graphs_outputs_are_copied_whole_and_apart() -> None:
    """What a captured side returns is copied before its next replay rewrites it
    (`side_graphs._cloned`, one multi-tensor copy per dtype): every tensor of the tree has new
    storage with the same values, dtype and shape; other leaves stay as they are."""
    from dsbd_core.algorithm.iteration.side_graphs import _cloned
    from dsbd_core.algorithm.scorer import ForestLayer
    from dsbd_core.algorithm.sequences.state import Forest

    ids = torch.arange(6).view(2, 3)
    scores = torch.rand(2, dtype=torch.float64)
    kept = torch.tensor([True, False])[None].expand(2, 2)  # not dense: copied all the same
    forest = Forest([ForestLayer(ids, ids[:, :2], kept)], [scores], [scores.float()], None)
    tree = (forest, {"x": ids, "y": [scores, 3]}, 7)
    copied = _cloned(tree)

    def tensors(t: Any) -> list[torch.Tensor]:
        if isinstance(t, torch.Tensor):
            return [t]
        if isinstance(t, dict):
            t = list(t.values())
        if isinstance(t, Forest):
            t = [t.layers, t.tables, t.probs]
        if isinstance(t, ForestLayer):
            t = [t.parent, t.token, t.exists]
        if isinstance(t, list | tuple):
            return [x for v in t for x in tensors(v)]
        return []

    before, after = tensors(tree), tensors(copied)
    assert len(before) == len(after) == 7
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape
        assert a.data_ptr() != b.data_ptr()
    assert copied[1]["y"][1] == 3 and copied[2] == 7 and copied[0].support is None
