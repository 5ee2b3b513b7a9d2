"""How often one engine iteration reads a tensor's value on the host: its syncs-to-be on a GPU.

On a GPU every `.item()`, `bool(tensor)`, `int(tensor)`, `.tolist()`, `.nonzero()` and
`torch.equal` of a device tensor waits for the device; the captured-graph issue wants at most
two per iteration. The engine runs on the host today, so this counts those reads on a CPU,
per iteration, on an exact n-gram table (no model: the reads are the engine's own), by wrapping
the tensor methods for the length of a decode.

    .venv/bin/python benchmarks/investigations/host_reads/host_reads.py \\
        [--width 3 --gamma 3 --threshold 0.7]

Prints the engine's reads per iteration (the iterations' own; the end of the decode, which
reads host copies of the results, and the table scorer are counted apart), by kind and by the
engine file and line that made them (the places to move onto the device first), and the
engine's own tensor operations per iteration (views left out): on a GPU each is a kernel
launch unless the step runs as a captured graph (`side_graphs.py`). `--device-branches`
takes the branches a GPU takes (`dsbd_core.algorithm.draws.host_reads`). Not a timing: the
machine's load does not matter.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

from dsbd.bench.decode.harness import git_info, machine_info
from dsbd_core import SamplingConfig, TableScorer
from dsbd_core.algorithm import engine as engine_module
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.drivers.loop import Decode, run_decode
from dsbd_core.algorithm.iteration.side_graphs import SideGraph
from dsbd_core.algorithm.methods import method_config

_PHASES = {"algorithm/result.py": "end", "algorithm/table_scorer.py": "scorer"}
READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


@contextmanager
def counted(where: collections.Counter, kinds: collections.Counter) -> Iterator[None]:
    """Count every host read of a tensor value made inside dsbd_core/algorithm."""
    saved: dict[str, Callable[..., Any]] = {}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = next(
                (
                    f
                    for f in reversed(traceback.extract_stack(limit=6)[:-1])
                    if "dsbd_core/algorithm" in f.filename
                ),
                None,
            )
            if frame is not None:
                kinds[name] += 1
                where[f"{frame.filename.split('dsbd_core/')[1]}:{frame.lineno}"] += 1
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, wrap(name, saved[name]))
    equal = torch.equal
    torch.equal = lambda a, b: (kinds.update(["equal"]), equal(a, b))[1]  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.equal = equal


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations run inside it, views left out (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self.paused and not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Uncounted:
    """A scorer whose own operations the counter leaves out (the engine's are counted)."""

    def __init__(self, inner: TableScorer, counter: OpCounter) -> None:
        self.inner, self.counter = inner, counter
        self.vocab_size = inner.vocab_size

    def set_roots(self, roots: Any) -> None:
        self.counter.paused = True
        try:
            self.inner.set_roots(roots)
        finally:
            self.counter.paused = False

    def forward(self, layers: Any) -> Any:
        self.counter.paused = True
        try:
            return self.inner.forward(layers)
        finally:
            self.counter.paused = False

    def release(self) -> None:
        self.inner.release()

    def scored(self, layers: Any) -> Any:
        """The forward inside a side's graph (`side_graphs.GraphScorer`), counted apart."""
        return self.inner.scored(layers)

    @property
    def forward_calls(self) -> int:
        return self.inner.forward_calls

    @forward_calls.setter
    def forward_calls(self, value: int) -> None:
        self.inner.forward_calls = value


@contextmanager
def graph_calls(calls: collections.Counter, counter: OpCounter) -> Iterator[None]:
    """Count the side graphs' calls, leaving their own operations out of `counter` (the
    dispatch mode steps aside while a graph runs, as it would not see a replay's kernels)."""
    original = SideGraph.__call__

    def call(self: SideGraph, *args: Any) -> Any:
        calls[self.eager.__name__] += 1  # draft_side, verify_side (or their engine parts)
        counter.paused = True
        try:
            with _pop_mode_temporarily():
                return original(self, *args)
        finally:
            counter.paused = False

    SideGraph.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        SideGraph.__call__ = original  # type: ignore[method-assign]


@contextmanager
def host_unpacking(counter: OpCounter) -> Iterator[None]:
    """Leave out the unpacking of the planning record: on a GPU it runs on the host's copy
    (no launch); on this CPU it looks like any other operation."""
    original = engine_module.unpacked

    def unpacked(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        counter.paused = True
        try:
            return original(buffer, like)
        finally:
            counter.paused = False

    engine_module.unpacked = unpacked
    try:
        yield
    finally:
        engine_module.unpacked = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="dsbd")
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument(
        "--device-branches", action="store_true", help="take the branches the engine takes on a GPU"
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="each side's engine work as its compiled graph (side_graphs.py, with"
        " --device-branches): their calls are counted, their operations left out",
    )
    args = parser.parse_args()
    sys.path.insert(0, ".")
    from tests.support.exact_reference import random_table  # the exactness tests' tables

    rng = np.random.default_rng(0)
    target = TableScorer(torch.from_numpy(random_table(rng, args.vocab, 3, concentration=0.5)))
    draft = TableScorer(torch.from_numpy(random_table(rng, args.vocab, 3, concentration=0.5)))
    config = SamplingConfig(
        width=args.width,
        gamma=args.gamma,
        threshold=args.threshold,
        max_new_tokens=args.tokens,
        seed=0,
        eos_token_ids=(),
    )
    where: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    counter = OpCounter()
    branches = computing_everywhere() if args.device_branches else contextlib.nullcontext()
    graphs: collections.Counter = collections.Counter()
    with (
        branches,
        counted(where, kinds),
        counter,
        graph_calls(graphs, counter),
        host_unpacking(counter),
    ):
        drafting = _Uncounted(draft, counter) if args.method != "beam" else None
        run = Decode(method_config(args.method, config), args.vocab, [[1, 2, 3]], graph=args.graph)
        result = run_decode(run, _Uncounted(target, counter), drafting)[0]
    iterations = result.stats.iterations
    # where a read is made: the iterations (the waits to cut), the end of the decode (once,
    # after the results crossed in one copy: host tensors there), the table scorer (a model)
    phase = collections.Counter()
    for place, n in where.items():
        phase[_PHASES.get(place.split(":")[0], "iterations")] += n
    report = {
        "machine": machine_info(torch.device("cpu")),
        **git_info(),
        "config": {
            "method": args.method,
            "width": args.width,
            "gamma": args.gamma,
            "threshold": args.threshold,
            "tokens": args.tokens,
        },
        "iterations": iterations,
        "engine_reads_per_iteration": phase["iterations"] / iterations,
        "scorer_reads_per_iteration": phase["scorer"] / iterations,
        "end_of_decode_reads": phase["end"],
        "reads_per_iteration": sum(kinds.values()) / iterations,
        "by_kind": {k: v / iterations for k, v in kinds.most_common()},
        "by_place": {k: v / iterations for k, v in where.most_common(15)},
        "device_branches": args.device_branches,
        "graph": args.graph,
        "graph_calls_per_iteration": {k: v / iterations for k, v in graphs.items()},
        "engine_ops_per_iteration": sum(counter.ops.values()) / iterations,
        "top_ops": {k: v / iterations for k, v in counter.ops.most_common(12)},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
