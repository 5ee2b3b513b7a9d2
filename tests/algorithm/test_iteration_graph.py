"""Between the model calls an iteration is one graph per side: CPU-side evidence that it can be
captured on a GPU.

`verify_forest.verify_scored` (verification, width, draws, bookkeeping, the next beams and the
pool) is compiled with `torch.compile(fullgraph=True)` while the CPU takes the device's branches
(`host_reads.computing_everywhere`): any read of a value on the host (`bool(t)`, `.item()`,
`.nonzero()`, `.tolist()`) is a graph break, and `fullgraph=True` makes a break an error. Its
draws are hashes of their counters computed inside the graph from the side's key, a tensor input
(`streams.Streams.on`), and it must return what the eager run returned, on every
iteration of decodes that finish beams at EOS mid-forest, fail layers, refill and take bonus
layers, for the fixed and the dynamic width rules (the distinct rule's simulated layers
included) and epsilon's relaxed acceptance. The draft's
layer between two draft-model calls (`draft_forest.draft_layer`) is checked the same way, and
whole decodes through `side_graphs.SideGraph` for both sides (compiled
once per shape, whatever the iteration's or the layer's key) give the eager decodes' tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from dsbd_core import SamplingConfig, TableScorer
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.draws.streams import DRAFT, Streams
from dsbd_core.algorithm.drivers.loop import Decode, run_decode
from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.iteration.draft_forest import draft_layer
from dsbd_core.algorithm.iteration.side_graphs import SideGraph, graph_for
from dsbd_core.algorithm.iteration.verify_forest import verify_scored
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.scorer import Roots
from dsbd_core.algorithm.sequences.state import Outcome
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.exact_reference import random_table
from tests.support.tiny_models import tiny

VOCAB, EOS = 12, 0
PROMPTS = [[3, 5, 7], [1, 2], [9, 4, 4, 8]]
CASES = [
    ("beam", {"width": 3}, False),
    ("sample", {"width": 1}, False),
    ("sps", {"width": 1, "gamma": 3}, True),
    ("dsbd-fixed", {"width": 3, "gamma": 3}, True),
    ("dsbd-ws4-topk", {"width": 3, "draft_width": 4, "gamma": 2, "top_k": 5}, True),
    ("dsbd-lean", {"width": 3, "gamma": 3, "lean_memory": True}, True),
    ("dsbd-repl", {"width": 2, "gamma": 2, "mode": "with_replacement"}, True),
    ("dsbd-dynamic", {"width": 3, "gamma": 3, "threshold": 0.7}, True),
    (
        "dsbd-dynamic-repl",
        {"width": 3, "gamma": 2, "threshold": 0.6, "mode": "with_replacement"},
        True,
    ),
    ("dsbd-dynamic-lean", {"width": 3, "gamma": 3, "threshold": 0.7, "lean_memory": True}, True),
    ("dsbd-epsilon", {"width": 2, "gamma": 2, "epsilon": 0.1}, True),
]


class _Opaque:
    """A table scorer seen only through `ForestScorer`: no `scored`, so its forwards stay out
    of the graphs (as a transformer's do) and each side's engine work is a graph of its own
    (tests/algorithm/test_fused_sides.py runs the table inside the graphs)."""

    def __init__(self, inner: TableScorer) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        self.inner.set_roots(roots)

    def forward(self, layers: list) -> object:
        return self.inner.forward(layers)

    def release(self) -> None:
        self.inner.release()


def _pair() -> tuple[TableScorer, TableScorer]:
    rng = np.random.default_rng(3)
    target = TableScorer(torch.from_numpy(random_table(rng, VOCAB, 3, concentration=0.5)))
    draft = TableScorer(torch.from_numpy(random_table(rng, VOCAB, 3, concentration=0.5)))
    return target, draft


def _flat(outcome: Outcome) -> dict[str, torch.Tensor]:
    """The outcome's tensors by name (the pool's entries and the record included)."""
    values = {
        name: getattr(outcome, name)
        for name in ("tokens", "length", "score", "alive", "remaining", "emitted")
    }
    values["origin.root"], values["origin.path"] = outcome.origin.root, outcome.origin.path
    for name, tensor in {**outcome.record, **outcome.counters}.items():
        values[f"record.{name}"] = tensor
    for field in dataclasses.fields(outcome.finished):
        for i, tensor in enumerate(getattr(outcome.finished, field.name)):
            if isinstance(tensor, torch.Tensor):
                values[f"pool.{field.name}.{i}"] = tensor
    return values


@pytest.mark.parametrize("mode", ["distinct", "with_replacement"])
def test_a_draft_layer_compiles_as_one_graph_and_draws_as_eager(mode: str) -> None:
    torch._dynamo.reset()
    _, draft = _pair()
    config = SamplingConfig(
        width=3, draft_width=4, gamma=3, top_p=0.9, mode=mode, seed=1, eos_token_ids=(EOS,)
    )
    engine = Engine(method_config("dsbd", config), VOCAB)
    state = engine.start(PROMPTS)
    counter = CompileCounter()
    compiled = torch.compile(draft_layer, fullgraph=True, backend=counter, dynamic=False)
    draft.set_roots(Roots(state.tokens, state.length, state.alive, state.origin))
    logq, sigma, ok = draft.forward([]).roots, state.score, state.alive
    with computing_everywhere():
        for level in range(1, 4):
            streams = Streams.side(7, level, 1)
            eager = draft_layer(sigma, logq, ok, config, None, engine.eos, streams.at(level, DRAFT))
            keyed = streams.on(torch.device("cpu")).at(level, DRAFT)
            graph = compiled(sigma, logq, ok, config, None, engine.eos, keyed)
            for a, b in zip(
                [*dataclasses.astuple(eager[0]), *eager[1:]],
                [*dataclasses.astuple(graph[0]), *graph[1:]],
                strict=True,
            ):
                assert torch.equal(a, b), (mode, level)
            layer, _, _, sigma, ok = eager
            logq = draft.forward([layer]).layers[0]
    assert counter.frame_count >= 1 and counter.op_count > 10


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fields", "drafts"), CASES, ids=[c[0] for c in CASES])
def test_a_decode_through_the_side_graphs_gives_the_eager_tokens(
    name: str, fields: dict, drafts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole decodes through `SideGraph` for both sides give the eager decodes' tokens and
    statistics, and every call of the verify side's graph returns what `verify_scored` returns
    eagerly on the same inputs (every tensor of the outcome, the pool's and the record's too),
    from fewer graphs than calls: the key is an input, so a new iteration's key is no new
    graph (shapes and depths are)."""
    torch._dynamo.reset()
    target, draft = _pair()
    config = SamplingConfig(
        **{"threshold": None, "max_new_tokens": 20, "seed": 9, "eos_token_ids": (EOS,)} | fields
    )
    graph = graph_for(torch.device("cpu"), verify_scored)
    draft_graph = graph_for(torch.device("cpu"), draft_layer)
    counter = CompileCounter()  # the verify side's graphs, run as Dynamo traced them
    compiled = torch.compile(verify_scored, fullgraph=True, backend=counter, dynamic=False)
    monkeypatch.setattr(graph, "compiled", compiled)
    before, draft_before = graph.replays, draft_graph.replays
    calls, pooled = [0], [0]
    through_graph = SideGraph.__call__

    def checked(side: SideGraph, *args: object) -> object:
        out = through_graph(side, *args)
        if side is graph:
            eager = verify_scored(*args)
            expected, actual = _flat(eager), _flat(out)
            assert sorted(actual) == sorted(expected)
            for key, value in expected.items():
                assert torch.equal(actual[key], value), (name, calls[0], key)
            calls[0] += 1
            pooled[0] += int(sum(int(k.sum()) for k in eager.finished.kept))
        return out

    monkeypatch.setattr(SideGraph, "__call__", checked)

    def decode(graphed: bool) -> list:
        run = Decode(
            method_config("dsbd" if drafts else "beam", config), VOCAB, PROMPTS, graph=graphed
        )
        return run_decode(run, _Opaque(target), _Opaque(draft) if drafts else None)

    with computing_everywhere():
        eager, graphed = decode(False), decode(True)
    assert graph.replays - before == calls[0] >= 3, "the graph was not replayed"
    assert counter.frame_count >= 1 and counter.op_count > 100
    assert counter.frame_count < calls[0]
    if name != "sample":
        assert pooled[0] > 0, "no beam finished at EOS: the pool's path was not exercised"
    if drafts:  # and the draft's layers ran as their graph
        assert draft_graph.replays - draft_before >= 2, "the draft layer's graph was not replayed"
    for a, b in zip(eager, graphed, strict=True):
        assert [(x.token_ids, x.log_likelihood, x.finished) for x in a.beams] == [
            (x.token_ids, x.log_likelihood, x.finished) for x in b.beams
        ], name
        assert a.stats.as_dict() == b.stats.as_dict(), name


@pytest.mark.slow
@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_a_model_decode_through_the_verify_graph_gives_the_eager_tokens(path: str) -> None:
    """The same through the transformer scorers, float32: the roots they plan from come
    with the engine's planning copy (`Roots.host`), the tables are float32."""
    torch._dynamo.reset()
    models = [tiny("llama", seed).to(torch.float32) for seed in (1, 2)]
    kind = StaticScorer if path == "static" else TransformerScorer
    config = SamplingConfig(
        width=3, gamma=3, threshold=None, max_new_tokens=16, seed=5, eos_token_ids=(EOS,)
    )

    def decode(graphed: bool) -> list:
        target, draft = (kind(model) for model in models)
        run = Decode(
            method_config("dsbd", config), target.vocab_size, [[1, 2, 3], [4, 5]], graph=graphed
        )
        return run_decode(run, target, draft)

    with computing_everywhere():
        eager, graphed = decode(False), decode(True)
    for a, b in zip(eager, graphed, strict=True):
        assert [x.token_ids for x in a.beams] == [x.token_ids for x in b.beams]
        assert a.stats.as_dict() == b.stats.as_dict()
