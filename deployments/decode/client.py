"""The ingress's side of a decode: hand it to a router replica, and to another when it dies.

A router replica that dies mid-decode (its process killed, its node gone) fails the handle call
with an error `decode.session.lost_replica` recognises. The call is self-contained
(`DecodeCall`), so it is handed again, after a short back-off, to whichever router replica Serve
picks (it waits for a replacement when none is left), up to `ATTEMPTS` times within the
request's deadline. Other errors are the request's and are raised as they are.

Why the output law stays exact: whether a decode is restarted depends only on a process dying,
never on what it sampled, so the restarted decode is a fresh draw from the same law. A request
with a seed draws the same random streams again, so where the numerics do not depend on the
batch (float64; docs/SERVING.md "Seeded decodes and numerics") its output is the one the lost
decode would have produced.

A stream that already sent tokens cannot take them back. The ingress gives every streamed
request a seed (drawn here when the client gave none: a seed drawn at random leaves the law as
it is), so the restarted decode replays the same tokens; the replayed tokens that were already
sent are skipped and the stream goes on. Should the replay commit a different token than was
sent (numerics that round with the batch's shape), the stream cannot continue consistently:
`ReplayDiverged` is raised, which the SSE stream reports as an error event.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from deployments.decode.session import lost_replica
from deployments.messages import Committed, DecodeCall, DecodeEnd

ATTEMPTS = 4  # the first call and three hand-overs (Serve replaces a router in ~5 s)
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 4.0


class ReplayDiverged(RuntimeError):
    """A restarted stream committed a token other than the one already sent."""


def with_seed(call: DecodeCall) -> DecodeCall:
    """`call` with a seed: the client's, else one drawn now (a stream's replay needs one)."""
    if call.config.seed is not None:
        return call
    seed = secrets.randbelow(2**62)  # the range the engine draws from (engine.py)
    return replace(call, config=call.config.model_copy(update={"seed": seed}))


async def _back_off(error: BaseException, attempt: int, handed: list[str]) -> None:
    """Wait before the next hand-over, or raise `error` when it is no lost router or the
    attempts are spent."""
    lost = lost_replica(error)
    if lost is None or attempt + 1 >= ATTEMPTS:
        raise error
    handed.append(f"attempt {attempt + 1}: {type(lost).__name__}")
    await asyncio.sleep(min(FIRST_DELAY_S * 2**attempt, MAX_DELAY_S))


async def decode(router: Any, call: DecodeCall, handed: list[str] | None = None) -> DecodeEnd:
    """The decode's end, from the first router replica that lives to finish it. `handed`
    collects one line per hand-over (for the request's stats)."""
    handed = [] if handed is None else handed
    attempt = 0
    while True:
        response = router.decode.remote(call)
        try:
            return await response
        except asyncio.CancelledError:
            # The caller gave up (the request deadline, a client gone): stop the router's
            # decode. Serve cancels a child call only when the request that made it is
            # cancelled, not when the awaiting task alone is, and the decode would otherwise run
            # to its end, holding its sessions and the replicas' time.
            response.cancel()
            raise
        except Exception as error:
            await _back_off(error, attempt, handed)
            attempt += 1


async def stream(
    router: Any, call: DecodeCall, handed: list[str] | None = None
) -> AsyncGenerator[Committed | DecodeEnd, None]:
    """The decode's committed tokens as they come, then its end; a restart replays the seeded
    decode and skips what was already yielded. `router`: a handle with `stream=True`."""
    handed = [] if handed is None else handed
    call = with_seed(call)
    sent: list[int] = []  # committed tokens yielded so far, over every attempt
    attempt = 0
    while True:
        replayed = 0  # tokens of this attempt matched against `sent`
        response = router.stream.remote(call)
        try:
            async for item in response:
                if isinstance(item, DecodeEnd):
                    if replayed < len(sent):
                        raise ReplayDiverged("the restarted decode ended before the sent tokens")
                    yield item
                    return
                known = min(len(item.ids), len(sent) - replayed)
                expected = sent[replayed : replayed + known]
                if item.ids[:known] != expected:
                    raise ReplayDiverged(
                        f"the restarted decode committed {item.ids[:known]} where {expected} "
                        "was sent"
                    )
                replayed += known
                if known < len(item.ids):
                    fresh = slice(known, None)
                    yield Committed(
                        item.ids[fresh],
                        item.chosen and item.chosen[fresh],
                        item.tops and item.tops[fresh],
                    )
                    sent.extend(item.ids[fresh])
                    replayed = len(sent)
            raise RuntimeError("the router's stream ended without the decode's end")
        except (ReplayDiverged, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as error:
            await _back_off(error, attempt, handed)
            attempt += 1
        finally:
            response.cancel()  # a stream left early (client gone, error) stops its decode
