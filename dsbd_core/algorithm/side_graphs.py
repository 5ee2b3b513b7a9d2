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
from collections.abc import Callable
from typing import Any

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.streams import Draws, Streams


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
