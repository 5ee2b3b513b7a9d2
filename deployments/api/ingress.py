"""The ingress: OpenAI-compatible and native HTTP API over the router, draft and verifier.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the `openai` client works as is;
DSBD knobs go in `extra_body`; `n` returns the top-n beams; `stream: true` streams SSE),
`GET /v1/models`, `POST /v1/dsbd/generate` (all beams and the full speculative-decoding
statistics), `GET /healthz`; FastAPI serves the OpenAPI schema at `/openapi.json` and `/docs`.
OpenAI's `logprobs` and vLLM's beam-search fields (`use_beam_search`, `length_penalty`, `n`)
are accepted (deployments/api/models.py).

Streaming sends the *committed* prefix of the best beam: the tokens every current candidate
starts with, which no later iteration can change (`decode.session.committed_tokens`). Beams of a
beam search can disagree for a while, so text arrives in steps; with one beam (`sample`, `sps`)
it is every token as it is accepted. A client that disconnects cancels the decode and frees its
caches (deployments/api/streaming.py).

Bad input is answered with HTTP 400 and an OpenAI-style error naming the field, the value given
and what is allowed (including this server's configured `Limits`); an unknown model with 404;
a missing or wrong API key (when one is configured) with 401; more concurrent decodes than
`max_concurrent_sessions` with 429; a decode past `request_timeout_s` with 504, its sessions
freed (deployments/api/errors.py; `Limits`: deployments/api/limits.py).


This module holds the ingress app and the `Ingress` class: the routes. Behind them, each served
model is a `ServedModel` (deployments/api/served_model.py: handles, tokenizer, limits, request
defaults, admission); a request goes to the model its `model` field names (the native route's
`model` defaults to the first one), an unknown name is a 404 listing the served ones, and
`/v1/models` lists them all. One model per application is what `build_app` deploys; Ray Serve
LLM's `llm_configs` (deployments/llm_serving.py) deploy several behind one ingress.
"""

from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from ray import serve

from deployments.api.auth import APIKeyGuard, guard_with, read_api_key
from deployments.api.errors import (
    APIError,
    api_error_handler,
    unhandled_error_handler,
    validation_error_handler,
)
from deployments.api.limits import Limits, RouterOptions
from deployments.api.models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ModelList,
)
from deployments.api.served_model import ServedModel
from deployments.observability.observers import RequestObserver, note_model

app = FastAPI(
    title="dsbd",
    summary="Dynamic-Width Speculative Beam Decoding: beam sampling at speculative speed.",
    version="0.1.0",
)
# Starlette runs the last added middleware first: the observer sees every response (401s
# included), the key guard runs before FastAPI reads or validates the body.
app.add_middleware(APIKeyGuard)  # the API key, when one is set (deployments/api/auth.py)
app.add_middleware(
    RequestObserver
)  # request spans and metrics (deployments/observability/observers.py)
# Every client error answers one OpenAI-style shape (deployments/api/errors.py).
app.add_exception_handler(APIError, api_error_handler)  # type: ignore[arg-type]  # Starlette types handlers as taking any Exception
app.add_exception_handler(RequestValidationError, validation_error_handler)  # type: ignore[arg-type]  # Starlette types handlers as taking any Exception
app.add_exception_handler(Exception, unhandled_error_handler)  # a replica lost for good: 503

# One served model's handles and options: router (or pair), draft, verifier, session registry,
# `RouterOptions` as a dict.
ModelHandles = tuple[Any, Any, Any, Any, dict[str, Any]]


@serve.ingress(app)
class Ingress:
    """Autoscaled HTTP ingress; hands each request's decode to its model's router replica."""

    def __init__(self, models: list[ModelHandles]) -> None:
        self.served: dict[str, ServedModel] = {}
        for handles in models:
            model = ServedModel(*handles)
            self.served[model.options.model_name] = model
        first = next(iter(self.served.values()))
        # one key per application (the builders check that every model names the same file)
        guard_with(read_api_key(first.options.api_key_file))
        self.first = first

    def _model(self, name: str | None) -> ServedModel:
        """The served model `name` names (None: the first); 404 listing the served ones."""
        model = self.first if name is None else self.served.get(name)
        if model is None:
            available = ", ".join(repr(n) for n in self.served)
            raise APIError(404, f"model={name!r} does not exist; available: {available}", "model")
        note_model(model.options.model_name)  # its own request metrics and span attribute
        return model

    @app.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        """Liveness and readiness: the ingress is up and every model's verifier answers."""
        health = {name: await model.healthz() for name, model in self.served.items()}
        first = health[self.first.options.model_name]
        return {**first, "models": list(health)}

    @app.get("/v1/dsbd/status")
    async def status(self, model: str | None = None) -> dict[str, Any]:
        """Load as the session registry sees it, and one verifier, one draft and one router
        replica of `model` (default: the first): id, pid, cached sessions and, when
        tensor-parallel, its ranks (pids, device); the ingress replica that answers (id, pid,
        decodes and session memory it admitted for that model). `dsbd bench chaos` kills
        replicas by these pids."""
        return {**await self._model(model).status(), "models": list(self.served)}

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[model.card() for model in self.served.values()])

    @app.post("/v1/completions", response_model=None)
    async def completions(self, request: CompletionRequest) -> Any:
        model = self._model(request.model)
        return await model.completions(model.with_defaults(request))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, request: ChatCompletionRequest) -> Any:
        model = self._model(request.model)
        return await model.chat_completions(model.with_defaults(request))

    @app.post("/v1/dsbd/generate")
    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        """One prompt; every beam with its log-likelihood, and the decode's statistics."""
        model = self._model(request.model)
        return await model.generate(model.with_defaults(request))


__all__ = ["Ingress", "Limits", "ModelHandles", "RouterOptions", "app"]
