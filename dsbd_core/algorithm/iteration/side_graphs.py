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

Where the model itself reads nothing (a `GraphScorer`: the exact n-gram table; the static
scorer beside the engine, with its host work around the graph, `PreparedScorer`), a whole
side is one graph, the model's forwards inside: `draft_side` (the gamma draft layers
unrolled, the draft's forwards between them) and `verify_side` (the forest forward,
verification, the next beams and the next iteration's plan packed into the one record the
host copies), for both engines: the sampling engine and the search engine (beam search, its
speculative form, beam sampling under transformers' law: fixed-shape top-K steps of the same
tables). An iteration past the prefill is then two graph calls and one read
(`tests/algorithm/test_fused_sides.py`, `tests/models/test_static_side.py`).

Graphs are per process, per function and per device (`graph_for`), as captured graphs are in
every engine that keeps them; Dynamo compiles again where a shape or a config differs (a new
gamma, batch or vocabulary).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.host_reads import packed
from dsbd_core.algorithm.draws.streams import Draws, Streams
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.sequences.state import (
    DecodeState,
    Forest,
    Outcome,
    deepest_layer,
    plan_iteration,
    planning_parts,
    roots_of,
)

T = TypeVar("T")


class SideSteps(Protocol):
    """An engine's two sides as generators of model calls (`engine.Engine`,
    `search.engine.SearchEngine`), as the fused sides run them."""

    config: SamplingConfig

    def propose_steps(
        self, state: DecodeState, streams: Streams | None = None, *, fused: bool = False
    ) -> Generator[ScoreCall, ForestLogprobs, Forest]: ...

    def verify_steps(
        self,
        state: DecodeState,
        forest: Forest,
        streams: Streams | None = None,
        *,
        fused: bool = False,
        then: Callable[[Outcome], Outcome] | None = None,
    ) -> Generator[ScoreCall, ForestLogprobs, Outcome]: ...


@runtime_checkable
class GraphScorer(Protocol):
    """A model whose forwards can sit inside a side's graph: `set_roots` and `scored` (its
    `forward` without the host counter, which would change every call) are functions of
    tensors that read nothing on the host. A side whose model is one runs whole as one graph
    (`draft_side`, `verify_side`): the draft's gamma layers unrolled, its forwards between them."""

    forward_calls: int

    def set_roots(self, roots: Any) -> None: ...

    def scored(self, layers: Sequence[ForestLayer]) -> ForestLogprobs: ...


@runtime_checkable
class PreparedScorer(Protocol):
    """A `GraphScorer` whose forwards need host work around the side's graph: before it (after
    the iteration's one read: its caches compacted, the side's metadata copied to the device;
    False where this iteration cannot run inside a graph, and the side is driven eagerly),
    a context the graph runs in, and the host's bookkeeping after it (the static path:
    `models/static_side.py`)."""

    def prepare_side(self, roots: Any, depth: int) -> bool: ...

    def side_context(self) -> contextlib.AbstractContextManager[Any]: ...

    def finish_side(self) -> None: ...


def graph_applies(config: SamplingConfig) -> bool:
    """The configs whose sides read nothing on a device: every width rule and both engines
    (beam search and transformers' law walk the search engine's fixed-shape steps), without
    log-probs (their rows are found by reading). The search engine's sides are graphs only
    whole, with their model (`draft_side`, `verify_side`)."""
    return config.logprobs is None


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
    """`tree` (dataclasses, dicts, lists of tensors) with every tensor copied.

    A fused iteration returns 20-60 tensors (the forest, the outcome, the plan); one `clone`
    each would be as many launches on a GPU after the replay. They are copied instead with one
    `_foreach_copy_` per device and dtype (a few multi-tensor launches)."""
    sources: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        sources.append(t)
        return t

    _mapped(tree, collect)
    copies = [torch.empty_like(t) for t in sources]
    groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
    for source, copy in zip(sources, copies, strict=True):
        into, out = groups.setdefault((source.device, source.dtype), ([], []))
        into.append(copy)
        out.append(source)
    for into, out in groups.values():
        torch._foreach_copy_(into, out)
    taken = iter(copies)
    return _mapped(tree, lambda _: next(taken))


def _mapped(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`tree` rebuilt with `fn` applied to every tensor, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: _mapped(value, fn) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_mapped(value, fn) for value in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        fields = dataclasses.fields(tree)
        return type(tree)(**{f.name: _mapped(getattr(tree, f.name), fn) for f in fields})
    return tree


def run_fused(
    scorer: GraphScorer, state: DecodeState, side: Callable[..., tuple[T, int]], *args: Any
) -> T | None:
    """`side` (`draft_side` or `verify_side`, called with `scorer` and `args`) as one graph on
    the state's device, with the scorer's host work around it (`PreparedScorer`) and its
    forwards counted on the host; None where the scorer cannot run this iteration inside a
    graph (`prepare_side`): the caller then drives the side's calls."""
    hooks = scorer if isinstance(scorer, PreparedScorer) else None
    if hooks is not None and not hooks.prepare_side(roots_of(state), deepest_layer(state)):
        return None
    graph = graph_for(state.alive.device, side)
    with hooks.side_context() if hooks is not None else contextlib.nullcontext():
        value, calls = graph(scorer, *args)
    if hooks is not None:
        hooks.finish_side()
    scorer.forward_calls += calls
    return value


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
    scorer: GraphScorer, engine: SideSteps, state: DecodeState, streams: Streams
) -> tuple[Forest, int]:
    """The whole draft side of `engine` (either engine: sampling or search), the draft model's
    forwards included: one graph per bucket."""
    return drive_scored(scorer, engine.propose_steps(state, streams, fused=True))


def verify_side(
    scorer: GraphScorer,
    engine: SideSteps,
    state: DecodeState,
    forest: Forest,
    streams: Streams,
    gamma: int,
) -> tuple[Outcome, int]:
    """The whole verify side of `engine`, the target's forest forward included, and the next
    iteration's plan at depth `gamma` (`state.plan_iteration`, packed into the record the host
    copies once when it plans: `planning_parts`): one graph per bucket."""
    max_new_tokens, prompt_len = engine.config.max_new_tokens, state.prompt_len

    def planned(outcome: Outcome) -> Outcome:
        ahead = plan_iteration(
            outcome.length, prompt_len, outcome.remaining, outcome.alive, max_new_tokens, gamma
        )
        ahead.record = packed(planning_parts(outcome.tokens, outcome.length, outcome.origin, ahead))
        outcome.plan = ahead
        return outcome

    steps = engine.verify_steps(state, forest, streams, fused=True, then=planned)
    return drive_scored(scorer, steps)
