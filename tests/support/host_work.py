"""What the host does during a decode: graph calls by function, host reads by kind (READS),
and the tensor operations it launches outside the graphs (`Ops`), counted within `counting`."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

from dsbd_core.algorithm import engine as engine_module
from dsbd_core.algorithm.iteration.side_graphs import SideGraph

READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


class Ops(TorchDispatchMode):
    """Counts the tensor operations run outside the graphs (views left out: no launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self.paused and not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(ops: Ops, calls: collections.Counter, reads: collections.Counter) -> Iterator[None]:
    """Within: graph calls by function, host reads by kind, and `ops` outside the graphs (a
    replay's kernels are not the host's launches). The planning record is unpacked on the
    host's copy: left out too."""
    call, unpacked, pool_add = SideGraph.__call__, engine_module.unpacked, engine_module.pool_add

    def graph_call(self: SideGraph, *args: Any) -> Any:
        calls[self.eager.__name__] += 1
        ops.paused = True
        try:
            with _pop_mode_temporarily():
                return call(self, *args)
        finally:
            ops.paused = False

    def host_unpacked(*args: Any) -> Any:
        ops.paused = True
        try:
            return unpacked(*args)
        finally:
            ops.paused = False

    def retiring(*args: Any, **kwargs: Any) -> Any:
        calls["retired"] += 1  # a session's budget ran out: its beams leave, eagerly
        return pool_add(*args, **kwargs)

    def reader(name: str, original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not ops.paused:
                reads[name] += 1
            return original(self, *args, **kwargs)

        return read

    saved = {name: getattr(torch.Tensor, name) for name in READS}
    SideGraph.__call__ = graph_call  # type: ignore[method-assign]
    engine_module.unpacked, engine_module.pool_add = host_unpacked, retiring
    for name, original in saved.items():
        setattr(torch.Tensor, name, reader(name, original))
    try:
        with ops:
            yield
    finally:
        SideGraph.__call__ = call  # type: ignore[method-assign]
        engine_module.unpacked, engine_module.pool_add = unpacked, pool_add
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
