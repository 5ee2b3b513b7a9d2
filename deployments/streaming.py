"""Server-sent events of a streamed completion (`stream: true`).

Streaming sends the *committed* prefix of the best beam: the tokens every current candidate
starts with, which no later iteration can change (`decode_session.committed_tokens`). Beams of a
beam search can disagree for a while, so text arrives in steps; with one beam (`sample`, `sps`)
it is every token as it is accepted. A client that disconnects cancels the decode and frees its
caches (`DecodeStream`).
"""

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from deployments.api_errors import timeout_body
from deployments.decode_session import DecodeSession, committed_tokens
from deployments.openai_responses import BeamText, finish_reason, usage
from deployments.router_limits import Limits


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
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._leave()


def loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


async def sse_events(
    session: DecodeSession, request: Any, prompt_ids: list[int], *, chat: bool,
    model_name: str, limits: Limits, texts: BeamText,
) -> AsyncIterator[str]:  # fmt: skip
    """SSE chunks: committed text of the best beam as it grows, then the final beams."""
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{session.session}"

    def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": finish}  # fmt: skip
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": None,
                      "finish_reason": finish}  # fmt: skip
            kind = "text_completion"
        body = {"id": ident, "object": kind, "created": created,
                "model": model_name, "choices": [choice]}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    sent = ""
    if chat:
        yield chunk(0, None, None, first=True)
    deadline = time.monotonic() + limits.request_timeout_s
    iterations = session.iterations(prompt_ids)
    try:
        while True:
            try:
                async with asyncio.timeout_at(loop_time(deadline)):
                    state = await anext(iterations)
            except StopAsyncIteration:
                break
            except TimeoutError:
                yield f"data: {json.dumps(timeout_body(limits.request_timeout_s))}\n\n"
                return
            text = texts.decode(committed_tokens(state))
            if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                yield chunk(0, text[len(sent) :], None)
                sent = text
    finally:
        await iterations.aclose()  # frees the sessions (also on a client that went away)
    beams = session.result().beams[: request.n]
    for index, beam in enumerate(beams):
        text = texts.text(beam)
        rest = text[len(sent) :] if index == 0 and text.startswith(sent) else text
        if index > 0 and chat:
            yield chunk(index, None, None, first=True)
        yield chunk(index, rest, finish_reason(beam))
    options = request.stream_options or {}
    if options.get("include_usage"):
        body = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model_name, "choices": [],
                "usage": usage(prompt_ids, beams).model_dump()}  # fmt: skip
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
