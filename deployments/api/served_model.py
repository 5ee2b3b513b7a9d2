"""One model behind the ingress: what the HTTP routes do for it.

The ingress (deployments/api/ingress.py) may serve several models (Ray Serve LLM's
`llm_configs`: deployments/llm_serving.py), routed by the request's `model`. Each is a
`ServedModel`: the handles of its router (or co-located pair), draft, verifier and width
controller, its tokenizer, its limits, its request defaults and its own admission (decodes
running and session memory admitted here), so one model's load never refuses another's
requests. It parses, checks and admits a request, and hands its decode to a `Router` replica
(deployments/decode/router.py), again to another one should that replica die
(deployments/decode/client.py): the process that answers HTTP holds no decode loop, so a router
lost mid-request costs the client time, not an error. The replies are built in
deployments/api/responses.py.
"""

import asyncio
import os
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from opentelemetry import trace
from ray.exceptions import RayError

from deployments.api.admission import MemoryLedger, router_view, session_charge
from deployments.api.errors import APIError, requested_config, timeout_body
from deployments.api.limits import RouterOptions, check_config
from deployments.api.models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ModelCard,
)
from deployments.api.responses import (
    BeamText,
    batch_completion_response,
    completion_response,
    echo_completion_response,
    native_beam_logprobs,
)
from deployments.api.streaming import DecodeStream, sse_events
from deployments.decode import client as router_client
from deployments.decode.local_handles import SideHandle
from deployments.decode.session import accepted_per_position
from deployments.decode.state import Handles
from deployments.messages import DecodeCall, DecodeEnd
from deployments.observability import tracing
from deployments.observability.observers import note_method
from deployments.observability.tracing import replica_id
from deployments.replicas.allocator import active_allocator, allocator_stats
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.methods import MethodConfig
from dsbd_core.algorithm.sequences.stops import StopStrings
from dsbd_core.models import load_tokenizer
from dsbd_core.models.token_bytes import TokenizerTexts

# How long the status waits for one replica's answer. A replica that died is not answered for
# until Serve has started its replacement (the handle holds the call for a live replica), which
# on a loaded machine takes longer than an operator's poll should hang.
REPLICA_ANSWER_S = 10.0


async def _answer(call: Any, timeout_s: float = REPLICA_ANSWER_S) -> dict[str, Any]:
    """A replica's `info` answer, or {"replica": None, "pid": None, "unanswered": why} when it
    does not answer in `timeout_s` (died, being replaced, unreachable while Ray's GCS is
    away): the status reports the others instead of failing or hanging with it."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except (TimeoutError, RayError) as error:
        if hasattr(call, "cancel"):
            call.cancel()  # not left queued for the replacement replica
        why = f"no answer in {timeout_s:g} s" if isinstance(error, TimeoutError) else str(error)
        return {"replica": None, "pid": None, "unanswered": (why.splitlines() or [repr(error)])[0]}


def _replica_status(info: dict[str, Any]) -> dict[str, Any]:
    if "unanswered" in info:
        return {**info, "cached_sessions": None}
    out = {
        "replica": info["replica"],
        "pid": info["pid"],
        "cached_sessions": len(info["cached_sessions"]),
        "calls_run": info.get("calls_run", 0),  # iterations it answered (a monotonic count)
        "tp_size": info.get("tp_size", 1),
        "allocator": info.get("allocator", "system"),
        "allocator_stats": info.get("allocator_stats", {}),
        "primitive_cache": info.get("primitive_cache"),
        "decode_path": info.get("decode_path", {"path": "dynamic"}),  # static: ladder, graphs
    }
    if "tp_ranks" in info:
        out["tp_ranks"] = info["tp_ranks"]
    return out


def _report_end(end: DecodeEnd) -> None:
    """What the request span reports of its decode (the router's spans are its children)."""
    span = trace.get_current_span()
    span.set_attribute("dsbd.session", end.session)
    span.set_attributes({f"dsbd.{name}": value for name, value in end.totals.items()})


T = TypeVar("T")


async def _each(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run the calls concurrently; their values in order. The first failure (a 400, 429, 504)
    cancels the others and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


class ServedModel:
    """One model's handles, tokenizer, limits, request defaults and admission."""

    def __init__(
        self, router: Any, draft: Any, verifier: Any, controller: Any, options: dict[str, Any]
    ) -> None:
        self.options = RouterOptions.model_validate(options)
        self.router = router
        self.router_stream = router.options(stream=True)
        if self.options.colocated:  # one Pair replica answers for both models
            draft, verifier = SideHandle(draft, "draft"), SideHandle(verifier, "verifier")
        self.handles = Handles(draft=draft, verifier=verifier, controller=controller)
        self.tokenizer, self.stop_ids = load_tokenizer(self.options.tokenizer)
        self.texts = BeamText(self.tokenizer)
        self._info: dict[str, Any] | None = None
        self._running = 0  # decodes in progress here (max_concurrent_sessions)
        self._memory = MemoryLedger()  # their session memory (deployments/api/admission.py)

    def card(self) -> ModelCard:
        """This model's entry in /v1/models."""
        return ModelCard(id=self.options.model_name)

    def with_defaults(self, request: Any) -> Any:
        """`request` with this model's request defaults (`RouterOptions.request_defaults`: an
        `llm_configs` entry's `engine_kwargs`) in the fields the client did not set."""
        unset = {
            name: value
            for name, value in self.options.request_defaults.items()
            if name not in request.model_fields_set
        }
        if not unset:
            return request
        return type(request).model_validate({**request.model_dump(exclude_unset=True), **unset})

    # ------------------------------------------------------------- what the routes do
    async def healthz(self) -> dict[str, Any]:
        """Liveness and readiness of this model: its verifier answers."""
        info = await self._model_info()
        return {"status": "ok", "model": self.options.model_name, "vocab_size": info["vocab_size"]}

    async def status(self) -> dict[str, Any]:
        """Load as the session registry sees it, and one verifier, one draft and one router
        replica: id, pid, cached sessions and, when tensor-parallel, its ranks (pids, device);
        the ingress replica that answers (id, pid, decodes and session memory it admitted).
        A replica that does not answer in `REPLICA_ANSWER_S` (one just killed, whose replacement
        is starting) is reported with pid None and why. `dsbd bench chaos` kills replicas by
        these pids."""
        load = await self.handles.controller.load.remote()
        verifier, draft, router = await asyncio.gather(
            _answer(self.handles.verifier.info.remote()),
            _answer(self.handles.draft.info.remote()),
            _answer(self.router.info.remote()),
        )
        ingress = {
            "replica": replica_id(),
            "pid": os.getpid(),
            "running": self._running,
            "admitted_memory_bytes": dict(self._memory.admitted),
            "admitted_memory_peak_bytes": dict(self._memory.peak),
            "allocator": active_allocator(),  # jemalloc unless asked otherwise (app.py)
            "allocator_stats": allocator_stats(),
        }
        return {
            "model": self.options.model_name,
            **load,
            "verifier": _replica_status(verifier),
            "draft": _replica_status(draft),
            "router": router,
            "ingress": ingress,
        }

    async def completions(self, request: CompletionRequest) -> Any:
        await self._check_token_fields(request)
        prompts = await self._prompt_ids(request.prompts)
        if request.echo:
            return await self._echo(request, prompts)
        if len(prompts) == 1:
            return await self._openai(request, prompts[0], chat=False)
        if request.stream:
            raise APIError(
                400,
                f"stream=true with a list of {len(prompts)} prompts is not "
                "supported; allowed: stream=false, or one prompt",
                "stream",
            )
        # every prompt its own decode, through the same admission and batching
        ends = await _each(
            self._openai(request, ids, chat=False, beams_only=True) for ids in prompts
        )
        return batch_completion_response(
            self.options.model_name, prompts, ends, request.n, self._texts(request)
        )

    async def chat_completions(self, request: ChatCompletionRequest) -> Any:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                f"model {request.model!r} has no chat template; use /v1/completions",
                "messages",
            )
        await self._check_token_fields(request)
        prompt_ids = self._chat_ids([m.model_dump() for m in request.messages])
        return await self._openai(request, prompt_ids, chat=True)

    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        """One prompt; every beam with its log-likelihood, and the decode's statistics."""
        await self._check_token_fields(request)
        if request.prompt_ids is not None:
            prompt_ids = list(request.prompt_ids)
        elif request.chat and getattr(self.tokenizer, "chat_template", None):
            prompt_ids = self._chat_ids([{"role": "user", "content": request.prompt}])
        else:
            prompt_ids = self.tokenizer.encode(request.prompt)
        config = requested_config(lambda: request.sampling_config(self.stop_ids))
        config = await self._config(
            config,
            request.method,  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
            prompt_ids,
            tokens_field="max_new_tokens",
        )
        handed: list[str] = []  # hand-overs to another router (deployments/decode/client.py)
        call = self._call(config, request.adaptive, prompt_ids, request.stop_strings)  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
        end = await self._run(call, handed)
        result = end.result
        texts = self._texts(request)
        stats = result.stats.as_dict()
        stats["accepted_per_position"] = accepted_per_position(result)
        stats["serving"] = {**end.serving, "handovers": handed}
        return {
            "model": self.options.model_name,
            "method": request.method,  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
            "prompt_tokens": len(prompt_ids),
            "beams": [
                {
                    "text": texts.text(beam),
                    "token_ids": beam.token_ids,
                    "log_likelihood": beam.log_likelihood,
                    "score": beam.score,
                    "finished": beam.finished,
                    "stop_reason": texts.stop_reason(beam),
                    **(
                        native_beam_logprobs(beam, texts) if beam.token_logprobs is not None else {}
                    ),
                }
                for beam in result.beams
            ],
            "stats": stats,
        }

    # ----------------------------------------------------------------- helpers
    async def _echo(self, request: CompletionRequest, prompts: list[list[int]]) -> Any:
        """`echo`: every prompt scored by the verifier when logprobs are asked (a target
        forward of its own), then decoded as usual unless `max_tokens` is 0; concurrently,
        the first failure being the reply."""

        async def one(ids: list[int]) -> tuple[Any, list]:
            if request.max_tokens == 0:  # nothing decoded: the limits are checked all the same
                config = requested_config(lambda: request.sampling_config(self.stop_ids, 1))
                await self._config(config, request.method, ids)  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
            scored = None
            if request.logprobs is not None:
                scored = await self.handles.verifier.prompt_logprobs.remote(ids, request.logprobs)
            beams = []
            if request.max_tokens != 0:
                beams = await self._openai(request, ids, chat=False, beams_only=True)
            return scored, beams

        done = await _each(one(ids) for ids in prompts)
        return echo_completion_response(
            self.options.model_name,
            prompts,
            [beams for _, beams in done],
            [scored for scored, _ in done],
            request.n,
            self._texts(request),
        )

    async def _prompt_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids (texts tokenized); an id outside the vocabulary is a 400
        naming where it stands."""
        vocab = int((await self._model_info())["vocab_size"])
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                out.append(self.tokenizer.encode(prompt))
                continue
            for j, token in enumerate(prompt):
                if token >= vocab:
                    where = f"prompt[{i}][{j}]" if len(prompts) > 1 else f"prompt[{j}]"
                    raise APIError(
                        400,
                        f"{where}={token}: token id out of range; allowed 0..{vocab - 1}",
                        "prompt",
                    )
            out.append(list(prompt))
        return out

    async def _openai(
        self, request: Any, prompt_ids: list[int], *, chat: bool, beams_only: bool = False
    ) -> Any:
        """One prompt's decode: the reply (streamed or not), or its beams (`beams_only`)."""
        config = requested_config(
            lambda: request.sampling_config(self.stop_ids, self.options.default_max_tokens)
        )
        config = await self._config(config, request.method, prompt_ids)
        if request.n > self.options.limits.max_n:
            raise APIError(
                400,
                f"n={request.n} exceeds this server's limit max_n={self.options.limits.max_n}",
                "n",
            )
        call = self._call(config, request.adaptive, prompt_ids, request.stop_strings)
        texts = self._texts(request)
        if request.stream:
            leave = self._admit(call)
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            updates = router_client.stream(self.router_stream, call)
            events = sse_events(
                updates,
                request,
                prompt_ids,
                chat=chat,
                model_name=self.options.model_name,
                limits=self.options.limits,
                texts=texts,
                ident=ident,
                stops=config.eos_token_ids,
                on_end=_report_end,
            )
            return DecodeStream(events, leave)
        beams = (await self._run(call)).result.beams[: request.n]
        if beams_only:
            return beams
        return completion_response(self.options.model_name, prompt_ids, beams, texts, chat=chat)

    def _admit(self, call: DecodeCall) -> Callable[[], None]:
        """Count a decode in, or refuse it (429) when this ingress runs too many already or
        their session memory leaves no room for its KV caches (deployments/api/admission.py);
        returns what counts it out, once however often it is called."""
        limit = self.options.limits.max_concurrent_sessions
        if self._running >= limit:
            raise APIError(
                429,
                f"this server runs {limit} decodes at once "
                "(max_concurrent_sessions); retry shortly",
                None,
            )
        view = (self._info or {}).get("admission")
        charge = session_charge(call.config, len(call.prompt_ids), view)
        self._memory.take(charge, view)
        self._running += 1
        counted = True

        def leave() -> None:
            nonlocal counted
            if counted:
                counted = False
                self._running -= 1
                self._memory.give_back(charge)

        return leave

    async def _run(self, call: DecodeCall, handed: list[str] | None = None) -> DecodeEnd:
        """Decode within the request deadline (504 past it; the sessions are freed either way),
        on a router replica, on another should it die (deployments/decode/client.py)."""
        leave = self._admit(call)
        try:
            async with asyncio.timeout(self.options.limits.request_timeout_s):
                end = await router_client.decode(self.router, call, handed)
        except TimeoutError:
            body = timeout_body(self.options.limits.request_timeout_s)["error"]
            raise APIError(504, body["message"], None) from None
        finally:
            leave()
        _report_end(end)
        return end

    def _call(
        self,
        config: MethodConfig,
        adaptive: bool,
        prompt_ids: list[int],
        stops: list[str] | None = None,
    ) -> DecodeCall:
        """The decode a router replica runs for this request (in the request span's trace);
        its stop strings matched through this server's tokenizer, named by its source."""
        assert self._info is not None
        stop = StopStrings(tuple(stops), TokenizerTexts(self.options.tokenizer)) if stops else None
        return DecodeCall(
            prompt_ids=list(prompt_ids),
            config=config,
            adaptive=adaptive,
            vocab_size=int(self._info["vocab_size"]),
            trace=tracing.inject(trace.get_current_span()),
            stop=stop,
        )

    def _texts(self, request: Any) -> BeamText:
        """The request's view of its beams' texts: cut at its stop strings."""
        return self.texts.with_stops(
            request.stop_strings,
            request.include_stop_str_in_output,
            request.stop_token_ids,
            request.min_tokens,
        )

    async def _check_token_fields(self, request: Any) -> None:
        """A 400 naming `stop_token_ids` or `logit_bias` for an id outside the vocabulary."""
        vocab = int((await self._model_info())["vocab_size"])
        for i, token in enumerate(request.stop_token_ids or ()):
            if token >= vocab:
                raise APIError(
                    400,
                    f"stop_token_ids[{i}]={token}: token id out of range; allowed 0..{vocab - 1}",
                    "stop_token_ids",
                )
        for key, token in zip(request.logit_bias or {}, request.logit_bias_ids, strict=True):
            if token >= vocab:
                raise APIError(
                    400,
                    f"logit_bias[{key!r}]: token id {token} out of range; allowed 0..{vocab - 1}",
                    "logit_bias",
                )

    async def _config(
        self,
        config: SamplingConfig,
        method: str,
        prompt_ids: list[int],
        *,
        tokens_field: str = "max_tokens",
    ) -> MethodConfig:
        """The method's config, checked against this server's limits and what the model can
        hold. Errors name the request's own fields: `tokens_field` is what the route calls the
        token budget (OpenAI `max_tokens`, native `max_new_tokens`); the draft width is W_S
        when the client set it, else the width it defaults to."""
        note_method(method)  # for dsbd_requests{method=...}, also when the checks refuse it
        info = await self._model_info()
        return check_config(config, method, prompt_ids, info, self.options.limits, tokens_field)

    async def _model_info(self) -> dict[str, Any]:
        if self._info is None:
            info = await self.handles.verifier.info.remote()
            draft = await self.handles.draft.info.remote()  # its session memory (admission)
            info["admission"] = router_view(info, draft, self.options.router_replicas)
            self._info = info
        return self._info

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids of a chat: the template's text, encoded without extra special tokens."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)
