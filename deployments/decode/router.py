"""The router: runs the decode loop of the requests the ingress hands it.

Why a deployment of its own, behind the HTTP ingress (deployments/api/ingress.py): the decode loop
is the part of the server that holds a request's state for seconds and talks to the draft and
the verifier every iteration. Were it in the process that answers HTTP, its death would end
those requests with Serve's HTTP 500. Here it is a replica the ingress calls through a handle
with a self-contained `DecodeCall`, so the ingress hands a request whose router died to another
one (deployments/decode/client.py): the client sees no error. A router holds nothing that
outlives a call: sessions live in the draft and verifier replicas (freed by `DecodeSession` and
their TTLs) and in the session registry (which forgets a silent router's sessions).

`decode` returns the whole result; `stream` yields the tokens each iteration commits
(`Committed`), then the result (`DecodeEnd`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from opentelemetry import context as otel_context

from deployments.decode.session import DecodeSession, committed_tokens
from deployments.decode.state import Handles, RouterState
from deployments.faults import fault_point
from deployments.messages import Committed, DecodeCall, DecodeEnd
from deployments.observability import tracing
from deployments.replicas.allocator import active_allocator, allocator_stats
from dsbd_core.algorithm.sequences.logprobs import beam_lists, prefix_logprobs
from dsbd_core.algorithm.sequences.state import DecodeState


@contextlib.contextmanager
def _request_context(call: DecodeCall) -> Iterator[None]:
    """The request span's context (from the ingress) as this task's current one: the
    iteration spans are its children."""
    context = tracing.extract(call.trace)
    token = otel_context.attach(context) if context is not None else None
    try:
        yield
    finally:
        if token is not None:
            with contextlib.suppress(ValueError):  # detached in another context: harmless
                otel_context.detach(token)


def committed_logprobs(
    state: DecodeState, count: int
) -> tuple[list[float], list[list[tuple[int, float]]]] | None:
    """The log-probs of the first `count` committed tokens (None when none are tracked); the
    committed tokens' values are final, as the tokens are."""
    values = prefix_logprobs(
        state.logprobs, state.alive, state.pool.session, state.pool.logprobs, count
    )
    if values is None:
        return None
    return beam_lists(values.reshape(1), 0, count)


class Router:
    """Autoscaled; one decode loop per call, all calls concurrent."""

    # split: the draft and the verifier are deployments of their own (the Pair: "colocated")
    LAYOUT = "split"

    def __init__(self, draft: Any, verifier: Any, controller: Any) -> None:
        # the calibration, cost policy, open sessions and heartbeat this replica keeps
        handles = Handles(draft=draft, verifier=verifier, controller=controller)
        self.state = RouterState(handles, layout=self.LAYOUT)
        self._running = 0  # decode loops in progress here

    async def info(self) -> dict[str, Any]:
        return {
            "replica": tracing.replica_id(),
            "pid": os.getpid(),
            "layout": self.LAYOUT,
            "calibration": self.state.calibration_status(),  # a failure shows here
            "running": self._running,
            "allocator": active_allocator(),
            "allocator_stats": allocator_stats(),
        }

    def _session(self, call: DecodeCall) -> DecodeSession:
        return DecodeSession(
            self.state,
            call.vocab_size,
            call.config,
            adaptive=call.adaptive,
            stop=call.stop,
        )

    async def decode(self, call: DecodeCall) -> DecodeEnd:
        """Decode to the end."""
        session = self._session(call)
        self._running += 1
        try:
            fault_point("router", "decode")  # off unless tests ask (deployments/faults.py)
            with _request_context(call):
                await session.run(call.prompt_ids)
        finally:
            self._running -= 1
        return _end(session)

    async def stream(self, call: DecodeCall) -> AsyncIterator[Committed | DecodeEnd]:
        """Decode, yielding what each iteration commits, then the end."""
        session = self._session(call)
        self._running += 1
        sent = 0
        try:
            fault_point("router", "stream")
            with _request_context(call):
                iterations = session.iterations(call.prompt_ids)
                try:
                    async for state in iterations:
                        ids = committed_tokens(state)
                        if len(ids) <= sent:
                            continue
                        values = committed_logprobs(state, len(ids))
                        chosen, tops = values if values is not None else (None, None)
                        yield Committed(ids[sent:], chosen and chosen[sent:], tops and tops[sent:])
                        sent = len(ids)
                finally:
                    await iterations.aclose()  # frees the sessions (also when cancelled)
        finally:
            self._running -= 1
        yield _end(session)


def _end(session: DecodeSession) -> DecodeEnd:
    return DecodeEnd(
        result=session.result(),
        session=session.session,
        serving=session.stats.as_dict(),
        totals=dict(session.totals),
    )
