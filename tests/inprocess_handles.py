"""Serve's handles without Ray: `handle.method.remote(*args)` calls a replica object in this
process and answers with an awaitable, as a `DeploymentHandle` does, so the serving path's real
classes (`DecodeSession`, `RouterState`, the replicas) run in a test in seconds."""

from __future__ import annotations

import asyncio
from typing import Any


class Method:
    """`handle.method.remote(*args)`: an awaitable response; a response passed as an argument
    is resolved first (the draft's forest to the verifier)."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> asyncio.Future:
        return asyncio.ensure_future(self._call(*args))

    async def _call(self, *args: Any) -> Any:
        resolved = [await a if isinstance(a, asyncio.Future) else a for a in args]
        return await self.method(*resolved)


class Handle:
    """A replica object behind a handle."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Method:
        return Method(getattr(self.target, name))
