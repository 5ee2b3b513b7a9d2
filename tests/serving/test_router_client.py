"""The ingress's hand-over of a decode whose router died (deployments/decode/client.py).

Handles are replaced by fakes that answer as Serve's do (an awaitable per `decode.remote`, an async
iterator per `stream.remote`) and fail with Ray's `ActorDiedError` where a real router would die.
The real path (a router SIGKILLed, or exiting inside its N-th decode, under load) is
tests/serving/test_faults.py and tests/serving/test_chaos.py; here the bookkeeping of a stream's
replay is checked case by case: nothing sent twice, nothing skipped, a replay that differs refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from deployments.decode import client as router_client
from deployments.messages import Committed, DecodeCall, DecodeEnd
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.methods import method_config


def _call(seed: int | None = None) -> DecodeCall:
    return DecodeCall(
        prompt_ids=[1, 2],
        config=method_config("dsbd", SamplingConfig(width=2, seed=seed)),
        adaptive=False,
        vocab_size=10,
    )


END = DecodeEnd(result=None, session="s", serving={}, totals={})  # type: ignore[arg-type]


class _Stream:
    """One `stream.remote` answer: `items`, then death (`die`) or the end."""

    def __init__(self, items: list[Committed], die: bool) -> None:
        self.items, self.die, self.cancelled = items, die, False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._run()

    async def _run(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item
        if self.die:
            raise ActorDiedError()
        yield END

    def cancel(self) -> None:
        self.cancelled = True


class _Router:
    """A router handle whose attempts play `plans` in turn: (committed lists, dies?)."""

    def __init__(self, plans: list[tuple[list[list[int]], bool]]) -> None:
        self.plans, self.calls, self.streams = plans, [], []
        self.stream, self.decode = self, self

    def remote(self, call: DecodeCall) -> Any:
        ids, die = self.plans[len(self.calls)]
        self.calls.append(call)
        stream = _Stream([Committed(i, [0.0] * len(i), [[]] * len(i)) for i in ids], die)
        self.streams.append(stream)
        return stream


def _collect(router: _Router, call: DecodeCall, handed: list[str]) -> list[Any]:
    async def run() -> list[Any]:
        return [item async for item in router_client.stream(router, call, handed)]

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def _no_back_off(monkeypatch) -> None:
    monkeypatch.setattr(router_client, "FIRST_DELAY_S", 0.0)


def test_a_stream_handed_over_sends_each_token_once() -> None:
    """Dies after committing [5, 6] and [7]; the replay commits [5, 6, 7, 8] at once, then
    [9]: the client gets 5, 6, 7 from the first router and 8, 9 from the second."""
    router = _Router([([[5, 6], [7]], True), ([[5, 6, 7, 8], [9]], False)])
    handed: list[str] = []
    items = _collect(router, _call(), handed)
    committed = [item.ids for item in items if isinstance(item, Committed)]
    assert committed == [[5, 6], [7], [8], [9]] and items[-1] is END
    fresh = next(item for item in items if isinstance(item, Committed) and item.ids == [8])
    assert fresh.chosen == [0.0] and fresh.tops == [[]]  # the log-probs sliced with the ids
    assert handed == ["attempt 1: ActorDiedError"]
    # the replay is the same seeded decode: a seed was drawn for it, and kept
    seeds = {call.config.seed for call in router.calls}
    assert len(seeds) == 1 and None not in seeds
    assert all(stream.cancelled for stream in router.streams)  # nothing left running


def test_a_replay_that_commits_another_token_is_refused() -> None:
    router = _Router([([[5, 6]], True), ([[5, 4]], False)])
    with pytest.raises(router_client.ReplayDiverged, match=r"committed \[5, 4\] where \[5, 6\]"):
        _collect(router, _call(seed=3), [])
    assert [call.config.seed for call in router.calls] == [3, 3]  # the client's seed


def test_a_replay_that_ends_short_of_what_was_sent_is_refused() -> None:
    router = _Router([([[5, 6, 7]], True), ([[5]], False)])
    with pytest.raises(router_client.ReplayDiverged, match="ended before"):
        _collect(router, _call(), [])


def test_hand_overs_stop_after_the_attempts() -> None:
    router = _Router([([], True)] * router_client.ATTEMPTS)
    handed: list[str] = []
    with pytest.raises(ActorDiedError):
        _collect(router, _call(), handed)
    assert len(router.calls) == router_client.ATTEMPTS
    assert len(handed) == router_client.ATTEMPTS - 1


def test_a_request_error_is_not_handed_over() -> None:
    class Failing:
        def __init__(self) -> None:
            self.decode, self.calls = self, 0

        async def _fail(self) -> None:
            raise ValueError("bad request")

        def remote(self, call: DecodeCall) -> Any:
            self.calls += 1
            return self._fail()

    router = Failing()
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(router_client.decode(router, _call()))
    assert router.calls == 1


def test_a_plain_decode_is_handed_over_as_is() -> None:
    class Dying:
        def __init__(self) -> None:
            self.decode, self.calls = self, []

        async def _answer(self) -> DecodeEnd:
            if len(self.calls) == 1:
                raise ActorDiedError()
            return END

        def remote(self, call: DecodeCall) -> Any:
            self.calls.append(call)
            return self._answer()

    router, handed = Dying(), []
    assert asyncio.run(router_client.decode(router, _call(), handed)) is END
    assert len(router.calls) == 2 and router.calls[0] is router.calls[1]  # no seed added
    assert handed == ["attempt 1: ActorDiedError"]


def test_a_decode_given_up_on_cancels_the_routers_call() -> None:
    """The ingress's deadline cancels the task awaiting the decode: the router's call is
    cancelled with it (else the decode runs to its end, holding its sessions)."""

    class Pending:
        def __init__(self) -> None:
            self.decode, self.cancelled = self, False

        def remote(self, call: DecodeCall) -> Any:
            return self

        def __await__(self) -> Any:
            return asyncio.sleep(3600).__await__()

        def cancel(self) -> None:
            self.cancelled = True

    async def run(router: Pending) -> None:
        async with asyncio.timeout(0.05):
            await router_client.decode(router, _call())

    router = Pending()
    with pytest.raises(TimeoutError):
        asyncio.run(run(router))
    assert router.cancelled
