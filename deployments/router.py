"""The ingress: OpenAI-compatible and native HTTP API over the draft/verifier deployments.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the `openai` client works as is;
DSBD knobs go in `extra_body`; `n` returns the top-n beams; `stream: true` streams SSE),
`GET /v1/models`, `POST /v1/dsbd/generate` (all beams and the full speculative-decoding
statistics), `GET /healthz`; FastAPI serves the OpenAPI schema at `/openapi.json` and `/docs`.

Streaming sends the *committed* prefix of the best beam: the tokens every current candidate
starts with, which no later iteration can change (`decode_session.committed_tokens`). Beams of a
beam search can disagree for a while, so text arrives in steps; with one beam (`sample`, `sps`)
it is every token as it is accepted. A client that disconnects cancels the decode and frees its
caches.

Bad input is answered with HTTP 400 and an OpenAI-style error naming the field, the value given
and what is allowed (including this server's configured `Limits`); an unknown model with 404;
a missing or wrong API key (when one is configured) with 401; more concurrent decodes than
`max_concurrent_sessions` with 429; a decode past `request_timeout_s` with 504, its sessions
freed.
"""

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from deployments.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    Usage,
)
from deployments.auth import APIKeyGuard, guard_with, read_api_key
from deployments.decode_session import (
    DecodeSession,
    Handles,
    accepted_per_position,
    committed_tokens,
)
from deployments.observability import RequestObserver, note_method
from dsbd_core.algorithm.config import SamplingConfig, config_error_message
from dsbd_core.algorithm.decoders import METHODS_WITH_DRAFT, method_config
from dsbd_core.algorithm.result import Beam, DecodeResult
from dsbd_core.models import load_tokenizer


class Limits(BaseModel):
    """What one request may ask of this server (checked before any model work: HTTP 400/429)."""

    model_config = ConfigDict(extra="forbid")

    max_prompt_tokens: int = Field(4096, ge=1, description="Prompt length in tokens.")
    max_new_tokens: int = Field(1024, ge=1, description="max_tokens / max_new_tokens.")
    max_width: int = Field(16, ge=1, description="Beam width W.")
    max_draft_width: int = Field(32, ge=1, description="Draft beams per layer W_S.")
    max_gamma: int = Field(8, ge=0, description="Draft depth.")
    max_n: int = Field(16, ge=1, description="Beams returned (OpenAI n).")
    max_concurrent_sessions: int = Field(
        256, ge=1, description="Decodes one router replica runs at once; more get HTTP 429."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A decode still running after this is stopped: HTTP 504."
    )


class RouterOptions(BaseModel):
    """What the router needs besides the handles."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("smollm2", description="The id /v1/models lists and requests name.")
    tokenizer: str = Field("smollm2", description="Where the target's tokenizer is read from.")
    default_max_tokens: int = Field(64, ge=1, le=32768)
    limits: Limits = Limits()
    api_key_file: str | None = Field(
        None, description="A file holding the API key clients must send (Bearer); without it, "
        "the DSBD_API_KEY environment variable; neither: no key. Never the key itself: Serve "
        "logs its application arguments.",
    )  # fmt: skip


class APIError(Exception):
    """An error a client can act on: HTTP status, message, offending parameter."""

    def __init__(
        self, status: int, message: str, param: str | None = None, *,
        kind: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers


app = FastAPI(
    title="dsbd",
    summary="Dynamic-Width Speculative Beam Decoding: beam sampling at speculative speed.",
    version="0.1.0",
)
# Starlette runs the last added middleware first: the observer sees every response (401s
# included), the key guard runs before FastAPI reads or validates the body.
app.add_middleware(APIKeyGuard)  # the API key, when one is set (deployments/auth.py)
app.add_middleware(RequestObserver)  # request spans and metrics (deployments/observability.py)


@app.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> JSONResponse:
    response = _error(error.status, error.message, error.param, kind=error.kind, code=error.code)
    response.headers.update(error.headers or {})
    return response


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    lines, param = [], None
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        param = param or field
        value = item.get("input")
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if not loc:  # a model-level rule: its message names the fields itself
            lines.append(message)
            continue
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{field}{shown}: {message}")
    return _error(400, "; ".join(lines), param)


def _error(
    status: int, message: str, param: str | None, *, kind: str | None = None,
    code: str | None = None,
) -> JSONResponse:  # fmt: skip
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# Module helpers stay above the class: Serve pickles the ingress class when it is decorated.
def _requested_config(build: Callable[[], SamplingConfig]) -> SamplingConfig:
    """The request's SamplingConfig, or 400 for a combination of knobs no decoder accepts (its
    cross-field rules). Only here is a pydantic error the client's: anywhere else it is a bug
    of the server and must show as one (500), not be passed off as bad input."""
    try:
        return build()
    except ValidationError as error:
        loc = error.errors()[0]["loc"]
        raise APIError(400, config_error_message(error).replace("\n", "; "),
                       str(loc[0]) if loc else None) from None  # fmt: skip


def _timeout_body(limits: Limits) -> dict[str, Any]:
    message = (f"the decode did not finish within request_timeout_s={limits.request_timeout_s}; "
               "it was stopped and its sessions freed; ask for fewer tokens or retry")  # fmt: skip
    return {"error": {"message": message, "type": "timeout", "param": None, "code": 504}}


def _loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


def _replica_status(info: dict[str, Any]) -> dict[str, Any]:
    out = {
        "replica": info["replica"],
        "pid": info["pid"],
        "cached_sessions": len(info["cached_sessions"]),
        "calls_run": info.get("calls_run", 0),  # iterations it answered (a monotonic count)
        "tp_size": info.get("tp_size", 1),
    }
    if "tp_ranks" in info:
        out["tp_ranks"] = info["tp_ranks"]
    return out


class _DecodeStream(StreamingResponse):
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


def _finish(beam: Beam) -> str:
    return "stop" if beam.finished else "length"


def _usage(prompt_ids: list[int], beams: list[Beam]) -> Usage:
    completion = sum(len(b.token_ids) for b in beams)
    return Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                 total_tokens=len(prompt_ids) + completion)  # fmt: skip


@serve.deployment(name="Router", max_ongoing_requests=256)
@serve.ingress(app)
class Router:
    """Autoscaled ingress; one decode loop per request, all requests concurrent."""

    def __init__(self, draft: Any, verifier: Any, controller: Any, options: dict[str, Any]) -> None:
        self.options = RouterOptions.model_validate(options)
        self.handles = Handles(draft=draft, verifier=verifier, controller=controller)
        self.tokenizer, self.stop_ids = load_tokenizer(self.options.tokenizer)
        self._info: dict[str, Any] | None = None
        guard_with(read_api_key(self.options.api_key_file))  # this process's app demands it
        self._running = 0  # decodes in progress here (max_concurrent_sessions)

    # ----------------------------------------------------------------- routes
    @app.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        """Liveness and readiness: the router is up and the verifier answers."""
        info = await self._model_info()
        return {"status": "ok", "model": self.options.model_name, "vocab_size": info["vocab_size"]}

    @app.get("/v1/dsbd/status")
    async def status(self) -> dict[str, Any]:
        """Load as the width controller sees it, and one verifier and one draft replica: id,
        pid, cached sessions and, when tensor-parallel, its ranks (pids, device)."""
        load = await self.handles.controller.load.remote()
        verifier = await self.handles.verifier.info.remote()
        draft = await self.handles.draft.info.remote()
        return {
            "model": self.options.model_name,
            **load,
            "verifier": _replica_status(verifier),
            "draft": _replica_status(draft),
        }

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.options.model_name)])

    @app.post("/v1/completions", response_model=None)
    async def completions(self, request: CompletionRequest) -> Any:
        self._check_model(request.model)
        prompt_ids = self.tokenizer.encode(request.prompt)
        return await self._openai(request, prompt_ids, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, request: ChatCompletionRequest) -> Any:
        self._check_model(request.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {request.model!r} has no chat template; use "
                           "/v1/completions", "messages")  # fmt: skip
        prompt_ids = self._chat_ids([m.model_dump() for m in request.messages])
        return await self._openai(request, prompt_ids, chat=True)

    @app.post("/v1/dsbd/generate")
    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        """One prompt; every beam with its log-likelihood, and the decode's statistics."""
        if request.prompt_ids is not None:
            prompt_ids = list(request.prompt_ids)
        elif request.chat and getattr(self.tokenizer, "chat_template", None):
            prompt_ids = self._chat_ids([{"role": "user", "content": request.prompt}])
        else:
            prompt_ids = self.tokenizer.encode(request.prompt)
        config = _requested_config(lambda: request.sampling_config(self.stop_ids))
        config = await self._config(config, request.method, prompt_ids,
                                    tokens_field="max_new_tokens")  # fmt: skip
        session = self._session(config, request.method, request.adaptive)
        result = await self._run(session, prompt_ids)
        stats = result.stats.as_dict()
        stats["accepted_per_position"] = accepted_per_position(result)
        stats["serving"] = session.stats.as_dict()
        return {
            "model": self.options.model_name,
            "method": request.method,
            "prompt_tokens": len(prompt_ids),
            "beams": [
                {
                    "text": self._text(beam),
                    "token_ids": beam.token_ids,
                    "log_likelihood": beam.log_likelihood,
                    "score": beam.score,
                    "finished": beam.finished,
                }
                for beam in result.beams
            ],
            "stats": stats,
        }

    # ----------------------------------------------------------------- helpers
    async def _openai(self, request: Any, prompt_ids: list[int], *, chat: bool) -> Any:
        stop_ids = self._stop_token_ids(request.stop_strings)
        stops = tuple(sorted(set(self.stop_ids) | set(stop_ids)))
        config = _requested_config(
            lambda: request.sampling_config(stops, self.options.default_max_tokens)
        )
        config = await self._config(config, request.method, prompt_ids)
        if request.n > self.options.limits.max_n:
            raise APIError(400, f"n={request.n} exceeds this server's limit max_n="
                           f"{self.options.limits.max_n}", "n")  # fmt: skip
        session = self._session(config, request.method, request.adaptive)
        if request.stream:
            leave = self._admit()
            return _DecodeStream(self._stream(session, request, prompt_ids, chat=chat), leave)
        result = await self._run(session, prompt_ids)
        beams = result.beams[: request.n]
        usage = _usage(prompt_ids, beams)
        if chat:
            return ChatCompletionResponse(
                model=self.options.model_name,
                usage=usage,
                choices=[
                    ChatChoice(
                        index=i,
                        message=AssistantMessage(content=self._text(b)),
                        finish_reason=_finish(b),
                    )  # fmt: skip
                    for i, b in enumerate(beams)
                ],
            )
        return CompletionResponse(
            model=self.options.model_name,
            usage=usage,
            choices=[
                CompletionChoice(index=i, text=self._text(b), finish_reason=_finish(b))
                for i, b in enumerate(beams)
            ],
        )

    async def _stream(
        self, session: DecodeSession, request: Any, prompt_ids: list[int], *, chat: bool
    ) -> AsyncIterator[str]:
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
                    "model": self.options.model_name, "choices": [choice]}  # fmt: skip
            return f"data: {json.dumps(body)}\n\n"

        sent = ""
        if chat:
            yield chunk(0, None, None, first=True)
        deadline = time.monotonic() + self.options.limits.request_timeout_s
        iterations = session.iterations(prompt_ids)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(_loop_time(deadline)):
                        state = await anext(iterations)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    yield f"data: {json.dumps(_timeout_body(self.options.limits))}\n\n"
                    return
                text = self._decode(committed_tokens(state))
                if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                    yield chunk(0, text[len(sent) :], None)
                    sent = text
        finally:
            await iterations.aclose()  # frees the sessions (also on a client that went away)
        beams = session.result().beams[: request.n]
        for index, beam in enumerate(beams):
            text = self._text(beam)
            rest = text[len(sent) :] if index == 0 and text.startswith(sent) else text
            if index > 0 and chat:
                yield chunk(index, None, None, first=True)
            yield chunk(index, rest, _finish(beam))
        options = request.stream_options or {}
        if options.get("include_usage"):
            usage = _usage(prompt_ids, beams).model_dump()
            body = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": self.options.model_name, "choices": [],
                    "usage": usage}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    def _admit(self) -> Callable[[], None]:
        """Count a decode in, or refuse it (429) when this router runs too many already;
        returns what counts it out, once however often it is called."""
        limit = self.options.limits.max_concurrent_sessions
        if self._running >= limit:
            raise APIError(429, f"this server runs {limit} decodes at once "
                           "(max_concurrent_sessions); retry shortly", None)  # fmt: skip
        self._running += 1
        counted = True

        def leave() -> None:
            nonlocal counted
            if counted:
                counted = False
                self._running -= 1

        return leave

    async def _run(self, session: DecodeSession, prompt_ids: list[int]) -> DecodeResult:
        """Decode within the request deadline (504 past it; the sessions are freed either way)."""
        leave = self._admit()
        try:
            async with asyncio.timeout(self.options.limits.request_timeout_s):
                return await session.run(prompt_ids)
        except TimeoutError:
            body = _timeout_body(self.options.limits)["error"]
            raise APIError(504, body["message"], None) from None
        finally:
            leave()

    def _session(self, config: SamplingConfig, method: str, adaptive: bool) -> DecodeSession:
        assert self._info is not None
        return DecodeSession(
            self.handles, int(self._info["vocab_size"]), config,
            uses_draft=method in METHODS_WITH_DRAFT, adaptive=adaptive,
        )  # fmt: skip

    async def _config(
        self, config: SamplingConfig, method: str, prompt_ids: list[int], *,
        tokens_field: str = "max_tokens",
    ) -> SamplingConfig:  # fmt: skip
        """The method's config, checked against this server's limits and what the model can
        hold. Errors name the request's own fields: `tokens_field` is what the route calls the
        token budget (OpenAI `max_tokens`, native `max_new_tokens`); the draft width is W_S
        when the client set it, else the width it defaults to."""
        note_method(method)  # for dsbd_requests{method=...}, also when the checks refuse it
        info = await self._model_info()
        vocab = int(info["vocab_size"])
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt_ids: token id {bad[0]} out of range; allowed "
                           f"0..{vocab - 1}", "prompt_ids")  # fmt: skip
        config = method_config(method, config)
        limits = self.options.limits
        draft_field = "draft_width" if config.draft_width is not None else "width"
        for field, value, limit, name in (
            ("prompt", len(prompt_ids), limits.max_prompt_tokens, "max_prompt_tokens"),
            (tokens_field, config.max_new_tokens, limits.max_new_tokens, "max_new_tokens"),
            ("width", config.width, limits.max_width, "max_width"),
            (draft_field, config.draft_beams, limits.max_draft_width, "max_draft_width"),
            ("gamma", config.gamma if method in METHODS_WITH_DRAFT else 0, limits.max_gamma,
             "max_gamma"),
        ):  # fmt: skip
            if value > limit:
                shown = f"prompt of {value} tokens" if field == "prompt" else f"{field}={value}"
                raise APIError(400, f"{shown} exceeds this server's limit {name}={limit}", field)
        gamma = config.gamma if method in METHODS_WITH_DRAFT else 0
        needed = len(prompt_ids) + config.max_new_tokens + gamma + 1
        limit = int(info["max_positions"])
        if needed > limit:
            raise APIError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({config.max_new_tokens}) + gamma "
                f"({gamma}) + 1 = {needed} exceeds the model's {limit} positions; allowed: a "
                f"shorter prompt or a smaller {tokens_field}",
                tokens_field,
            )
        return config

    async def _model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.handles.verifier.info.remote()
        return self._info

    def _check_model(self, model: str) -> None:
        if model != self.options.model_name:
            raise APIError(404, f"model={model!r} does not exist; available: "
                           f"{self.options.model_name!r}", "model")  # fmt: skip

    def _stop_token_ids(self, stops: list[str]) -> list[int]:
        ids = []
        for stop in stops:
            encoded = self.tokenizer.encode(stop, add_special_tokens=False)
            if len(encoded) != 1:
                raise APIError(400, f"stop={stop!r} is {len(encoded)} tokens; allowed: stop "
                               "strings that are exactly one token", "stop")  # fmt: skip
            ids.append(encoded[0])
        return ids

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids of a chat: the template's text, encoded without extra special tokens."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _text(self, beam: Beam) -> str:
        """The beam's text without its stop token (OpenAI leaves the stop sequence out)."""
        ids = beam.token_ids
        if beam.finished and ids:
            ids = ids[:-1]
        return self._decode(ids)


__all__ = ["Router", "RouterOptions", "DecodeResult", "app"]
