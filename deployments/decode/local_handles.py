"""Serve's handle interface over objects in this process: `handle.method.remote(*args)` runs
`obj.method(*args)` as a task and answers with an awaitable, as a `DeploymentHandle` does.

Why: the decode loop (`DecodeSession`) talks to the draft and the verifier through handles. In
the co-located layout (deployments/decode/pair.py) both models live in the loop's own process,
and the same loop drives them through these handles: no Serve call, no object-store trip for
the forest, nothing serialised. A task passed as an argument (the draft's forest handed to the
verifier) is awaited first, as Serve resolves a `DeploymentResponse` argument. The tests drive
the serving path's real classes without Ray through the same handles.
"""

from __future__ import annotations

import asyncio
from typing import Any


class LocalMethod:
    """`handle.method.remote(*args)`: an awaitable task; awaitable arguments resolved first."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> asyncio.Future:
        return asyncio.ensure_future(self._call(*args))

    async def _call(self, *args: Any) -> Any:
        resolved = [await a if isinstance(a, asyncio.Future) else a for a in args]
        return await self.method(*resolved)


class LocalHandle:
    """An object of this process behind a handle."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> LocalMethod:
        return LocalMethod(getattr(self.target, name))


class SideHandle:
    """One model side of a co-located pair replica, seen through the pair's Serve handle:
    `side.info.remote()` calls `pair.draft_info.remote()` (the ingress asks the draft and the
    verifier for their info and the verifier for prompt log-probs, whichever layout serves)."""

    def __init__(self, pair: Any, side: str) -> None:
        self._pair, self._side = pair, side

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pair, f"{self._side}_{name}")
