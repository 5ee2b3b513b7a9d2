"""Each side's engine work between two model calls as one compiled graph (opt-in:
`IterationCall.graph`, `Decode(graph=True)`).

Where the engine lives on a device, everything after the target's forward (`verify_scored`:
verification, width, draws, the next beams, the pool) and everything between two draft-model
calls (`draft_forest.draft_layer`: the layer's table, its draws, the drafts' scores) are
fixed-shape functions of tensors with no read on the host, for every width rule
(`graph_applies`). Run eagerly the verify side is ~1,400 small kernels a fixed-width DSBD
iteration and ~2,300 with dynamic width (W = 3, gamma = 3;
`benchmarks/investigations/host_reads/host_reads.py`), each a launch of several microseconds on
a GPU; compiled with `torch.compile(fullgraph=True)` on the `cudagraphs` backend each is one
graph replay. Their draws need no generator: every uniform is a hash of its counters
(`streams.py`), and the key enters the graph as a tensor (`Streams.on`, `Draws.on`), so one
capture serves every iteration and layer and draws inside the graph what the eager path draws.
The tokens are those of the eager path (`tests/algorithm/test_iteration_graph.py` decodes
through both with the `eager` backend on the CPU).

Graphs are per process, per function and per device (`graph_for`), as captured graphs are in
every engine that keeps them; Dynamo compiles again where a shape or a config differs (a new
gamma, batch or vocabulary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draft_forest import draft_forest
from dsbd_core.algorithm.host_reads import packed
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.state import (
    DecodeState,
    Forest,
    Outcome,
    plan_iteration,
    planning_parts,
)
from dsbd_core.algorithm.streams import Draws, Streams
from dsbd_core.algorithm.verify_forest import verify_forest, verify_scored

T = TypeVar("T")


@runtime_checkable
class GraphScorer(Protocol):
    """A model whose forwards can sit inside a side's graph: `set_roots` and `scored` (its
    `forward` without the host counter, which would change every call) are functions of
    tensors that read nothing on the host. A side whose model is one runs whole as one graph
    (`draft_side`, `verify_side`): the draft's gamma layers unrolled, its forwards between them."""

    forward_calls: int

    def set_roots(self, roots: Any) -> None: ...

    def scored(self, layers: Sequence[ForestLayer]) -> ForestLogprobs: ...


def graph_applies(config: SamplingConfig) -> bool:
    """The configs whose verify side reads nothing on a device: every width rule, without
    log-probs (their rows are found by reading), on the sampling engine (the search engine's
    walk is not compiled: docs/ARCHITECTURE.md "Where the engine runs")."""
    return config.logprobs is None and not config.searching


class SideGraph:
    """One side's engine function (`verify_scored` after the target's forward, `draft_layer`
    between two draft-model calls), compiled once per shape and config. Its random key, the
    argument that is `Streams` or `Draws`, is moved to the device as a tensor input, so one
    graph serves every iteration and layer (the layer is in the key, not in the graph)."""

    def __init__(self, fn: Callable[..., Any], device: torch.device) -> None:
        self.eager = fn
        self.device = device
        self.backend = "cudagraphs" if device.type == "cuda" else "eager"
        # a graph per shape, depth and config: past Dynamo's default of 8, `fullgraph` fails
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        self.compiled = torch.compile(fn, fullgraph=True, backend=self.backend, dynamic=False)
        self.replays = 0

    def __call__(self, *args: Any) -> Any:
        keyed = [a.on(self.device) if isinstance(a, Streams | Draws) else a for a in args]
        if self.backend == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled(*keyed)
        self.replays += 1
        # a captured graph's outputs are its buffers, rewritten by its next replay
        return _cloned(out) if self.backend == "cudagraphs" else out


_GRAPHS: dict[tuple[torch.device, Callable[..., Any]], SideGraph] = {}


def graph_for(device: torch.device, fn: Callable[..., Any]) -> SideGraph:
    """This process's graph of `fn` (`verify_scored` or `draft_layer`) for `device`: CUDA
    graphs on CUDA, Dynamo's traced graph run eagerly elsewhere. The engine takes it only where
    it keeps its state on a device (on the CPU: where the tests force the device's branches);
    the CPU gains nothing from a graph."""
    graph = _GRAPHS.get((device, fn))
    if graph is None:
        graph = _GRAPHS[(device, fn)] = SideGraph(fn, device)
    return graph


def _cloned(tree: Any) -> Any:
    """`tree` (dataclasses, dicts, lists of tensors) with every tensor copied."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cloned(value) for value in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        fields = dataclasses.fields(tree)
        return type(tree)(**{f.name: _cloned(getattr(tree, f.name)) for f in fields})
    return tree


def drive_scored(
    scorer: GraphScorer, steps: Generator[ScoreCall, ForestLogprobs, T]
) -> tuple[T, int]:
    """`scorer.drive` for a side inside a graph: the generator's value and how many forwards
    it made (the caller counts them on the host, outside the graph). Dynamo traces the value
    through only as a return value: read nothing of it inside the graph."""
    calls = 0
    try:
        call = next(steps)
        while True:
            if call.roots is not None:
                scorer.set_roots(call.roots)
            calls += 1
            call = steps.send(scorer.scored(call.layers))
    except StopIteration as stop:
        return stop.value, calls


def draft_side(
    scorer: GraphScorer,
    state: DecodeState,
    config: SamplingConfig,
    vocab: int,
    eos: torch.Tensor,
    streams: Streams,
) -> tuple[Forest, int]:
    """The whole draft side, the draft model's forwards included: one graph per bucket."""
    return drive_scored(scorer, draft_forest(state, config, vocab, eos, streams))


def verify_side(
    scorer: GraphScorer,
    state: DecodeState,
    forest: Forest,
    config: SamplingConfig,
    vocab: int,
    eos: torch.Tensor,
    streams: Streams,
    gamma: int,
) -> tuple[Outcome, int]:
    """The whole verify side, the target's forest forward included, and the next iteration's
    plan at depth `gamma` (`state.plan_iteration`: the host then reads it in the planning copy
    without computing it): one graph per bucket."""

    def verified(*args: Any) -> Outcome:
        outcome = verify_scored(*args)
        ahead = plan_iteration(
            outcome.length,
            state.prompt_len,
            outcome.remaining,
            outcome.alive,
            config.max_new_tokens,
            gamma,
        )
        ahead.record = packed(planning_parts(outcome.tokens, outcome.length, outcome.origin, ahead))
        outcome.plan = ahead
        return outcome

    steps = verify_forest(state, forest, config, vocab, eos, streams, verified)
    return drive_scored(scorer, steps)
