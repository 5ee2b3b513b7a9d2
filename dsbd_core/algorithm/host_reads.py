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

import torch

_EVERYWHERE = False


def may_read(tensor: torch.Tensor) -> bool:
    """True when reading `tensor`'s values costs no wait: it lives on the host's CPU."""
    return tensor.device.type == "cpu" and not _EVERYWHERE


@contextmanager
def computing_everywhere() -> Iterator[None]:
    """Within: the engine takes the branches it takes on a device on the CPU too (tests)."""
    global _EVERYWHERE
    saved, _EVERYWHERE = _EVERYWHERE, True
    try:
        yield
    finally:
        _EVERYWHERE = saved
