"""Where the engine may read a tensor's value on the host, and where it computes instead.

On the host a read such as `bool(mask.any())` is free, and the engine uses many of them to skip
vocabulary-wide work no session needs (a rejection nobody made, a softmax row without mass).
On a GPU each such read waits until the device has run everything queued before it. So where a
shortcut only saves work (never a random draw, never a change of what is returned), the engine
takes it on the host and computes the general case on a device: the same values either way.

`computing_everywhere()` makes the CPU take the device's branches too: how tests check, on a
machine without a GPU, that the branches a GPU takes give the tokens the host's give.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_EVERYWHERE = False


def may_read(tensor: torch.Tensor) -> bool:
    """True when reading `tensor`'s values costs no wait: it lives on the host's CPU."""
    return tensor.device.type == "cpu" and not _EVERYWHERE


def on_host(tree: T) -> T:
    """`tree` (dicts, lists and tuples of tensors) with every tensor on the host, moved in ONE
    copy when any lives on a device: each separate copy would wait for the device once. The
    values travel as float64 (exact for every integer below 2**53 and every float32), and come
    back in their own dtypes."""
    tensors: list[torch.Tensor] = []
    _collect(tree, tensors)
    return _rebuild(tree, iter(one_copy(tensors, torch.device("cpu"))))


def one_copy(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`tensors` on `device`, in one copy when any lives elsewhere (each separate copy from a
    GPU would wait for it once), through one float64 buffer: exact for every integer below
    2**53, every flag and every float32 and float64 value."""
    if all(t.device == device for t in tensors):
        return list(tensors)
    return unpacked(packed(tensors).to(device), tensors)


def packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, flattened into one float64 buffer."""
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def unpacked(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`packed`'s buffer split back into tensors of `like`'s shapes and dtypes."""
    parts, start = [], 0
    for t in like:
        parts.append(buffer[start : start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return parts


def _collect(tree: object, into: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        into.append(tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            _collect(value, into)
    elif isinstance(tree, list | tuple):
        for value in tree:
            _collect(value, into)


def _rebuild(tree: Any, parts: Iterator[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return next(parts)
    if isinstance(tree, dict):
        return {key: _rebuild(value, parts) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_rebuild(value, parts) for value in tree)
    return tree


@contextmanager
def computing_everywhere() -> Iterator[None]:
    """Within: the engine takes the branches it takes on a device on the CPU too (tests)."""
    global _EVERYWHERE
    saved, _EVERYWHERE = _EVERYWHERE, True
    try:
        yield
    finally:
        _EVERYWHERE = saved
