"""Server-sent events of a streamed completion (`stream: true`).

Streaming sends the *committed* prefix of the best beam: the tokens every current candidate
starts with, which no later iteration can change (`decode.session.committed_tokens`). Beams of a
beam search can disagree for a while, so text arrives in steps; with one beam (`sample`, `sps`)
it is every token as it is accepted. A client that disconnects cancels the decode and frees its
caches (`DecodeStream`). With logprobs asked, every chunk carries the log-probs of the tokens
whose text it adds (taken from the decode's state: the committed tokens' values are final too).
With stop strings, a chunk never sends text a later stop match would cut: the committed text is
cut at a stop string in it, and the longest end of it that begins a stop string is held back
until the next tokens show whether the stop follows (`stop_text.held_back`).
The router replica that runs the decode sends the committed tokens (deployments/decode/router.py); a
router that dies mid-stream is replaced without the client noticing (deployments/decode/client.py).
"""

import asyncio
import json
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from deployments.api.errors import replica_lost_body, timeout_body
from deployments.api.limits import Limits
from deployments.api.models import ChatLogprobs, CompletionLogprobs
from deployments.api.responses import BeamText, finish_reason, usage
from deployments.decode.client import ReplayDiverged
from deployments.messages import Committed, DecodeEnd
from dsbd_core.algorithm.sequences.stop_text import first_stop, held_back


class DecodeStream(StreamingResponse):
    """A streamed decode that always ends: however the response ends (finished, client gone,
    cancelled before its first chunk) its body is closed, which frees the decode's sessions,
    and its admission is counted out (`leave`). Starlette leaves an interrupted body iterator
    to the garbage collector, and one it never started holds no `finally` at all."""

    def __init__(self, body: AsyncIterator[str], leave: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._leave = leave
        weakref.finalize(self, leave)  # a response that is dropped without ever being run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # StreamingResponse's body is an async generator here
            finally:
                self._leave()


def loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


async def sse_events(
    updates: AsyncGenerator[Committed | DecodeEnd, None],
    request: Any,
    prompt_ids: list[int],
    *,
    chat: bool,
    model_name: str,
    limits: Limits,
    texts: BeamText,
    ident: str,
    stops: tuple[int, ...],
    on_end: Callable[[DecodeEnd], None] | None = None,
) -> AsyncIterator[str]:
    """SSE chunks: committed text of the best beam as it grows (`updates`: the router's
    `Committed` tokens, then its `DecodeEnd`), then the final beams; with logprobs asked, each
    chunk carries those of the tokens its text adds. `on_end` sees the decode's end."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(
        index: int,
        text: str | None,
        finish: str | None,
        first: bool = False,
        logprobs: Any = None,
        stop_reason: str | int | None = None,
    ) -> str:
        shown = logprobs.model_dump() if logprobs is not None else None
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish}
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": shown,
                "finish_reason": finish,
            }
        if finish is not None:
            choice["stop_reason"] = stop_reason
        body = {
            "id": ident,
            "object": kind,
            "created": created,
            "model": model_name,
            "choices": [choice],
        }
        return f"data: {json.dumps(body)}\n\n"

    sent, sent_ids = "", 0  # the best beam's text streamed so far, and its tokens
    if chat:
        yield chunk(0, None, None, first=True)
    deadline = time.monotonic() + limits.request_timeout_s
    committed = _Committed()
    end: DecodeEnd | None = None
    try:
        while end is None:
            try:
                async with asyncio.timeout_at(loop_time(deadline)):
                    update = await anext(updates)
            except StopAsyncIteration:
                break
            except TimeoutError:
                yield f"data: {json.dumps(timeout_body(limits.request_timeout_s))}\n\n"
                return
            except ReplayDiverged as diverged:
                yield f"data: {json.dumps(replica_lost_body(str(diverged)))}\n\n"
                return
            if isinstance(update, DecodeEnd):
                end = update
                break
            committed.add(update)
            ids = committed.ids
            if ids and ids[-1] in stops:  # a stop token is never part of the text
                ids = ids[:-1]
            text = streamable(texts.decode(ids), texts, texts.stop_floor(ids))
            if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                logprobs = committed.logprobs(texts, ids, sent_ids, chat)
                yield chunk(0, text[len(sent) :], None, logprobs=logprobs)
                sent, sent_ids = text, len(ids)
    finally:
        await updates.aclose()  # stops the decode (also on a client that went away)
    if end is None:
        raise RuntimeError("the decode's stream ended without its result")
    if on_end is not None:
        on_end(end)
    beams = end.result.beams[: request.n]
    for index, beam in enumerate(beams):
        text = texts.text(beam)
        resume = index == 0 and text.startswith(sent)
        rest = text[len(sent) :] if resume else text
        if index > 0 and chat:
            yield chunk(index, None, None, first=True)
        logprobs = texts.beam_logprobs(beam, chat=chat, start=sent_ids if resume else 0)
        stop_reason = texts.stop_reason(beam)
        yield chunk(index, rest, finish_reason(beam), logprobs=logprobs, stop_reason=stop_reason)
    options = request.stream_options or {}
    if options.get("include_usage"):
        body = {
            "id": ident,
            "object": kind,
            "created": created,
            "model": model_name,
            "choices": [],
            "usage": usage(prompt_ids, beams).model_dump(),
        }
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def streamable(text: str, texts: BeamText, after: int = 0) -> str:
    """What of a committed text may be sent: all of it without stop strings; else cut at a
    stop string in it (one ending past `after` characters: `BeamText.stop_floor`), less the
    end that begins one (unless the stop is kept in the text, then a later match cuts nothing
    already there)."""
    if not texts.stops:
        return text
    found = first_stop(text, texts.stops, after)
    if found is not None:
        return texts.cut(text, *found)
    if texts.include_stop:
        return text
    return text[: len(text) - held_back(text, texts.stops)]


class _Committed:
    """The committed tokens received so far, with their log-probs when tracked."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.chosen: list[float] | None = None
        self.tops: list[list[tuple[int, float]]] | None = None

    def add(self, update: Committed) -> None:
        self.ids.extend(update.ids)
        if update.chosen is not None and update.tops is not None:
            self.chosen = (self.chosen or []) + update.chosen
            self.tops = (self.tops or []) + update.tops

    def logprobs(
        self, texts: BeamText, ids: list[int], start: int, chat: bool
    ) -> ChatLogprobs | CompletionLogprobs | None:
        """The log-probs of the committed tokens `ids[start:]` (None when none are tracked)."""
        if self.chosen is None or self.tops is None:
            return None
        chosen, tops = self.chosen[start : len(ids)], self.tops[start : len(ids)]
        if chat:
            return texts.chat_logprobs(ids[start:], chosen, tops)
        return texts.completion_logprobs(ids, start, chosen, tops)
