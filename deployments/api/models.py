"""HTTP request/response models: OpenAI-compatible completions and chat, plus the native API.

The DSBD knobs (width, gamma, threshold, ...) are accepted as extra body fields, which is where
the `openai` client's `extra_body=` puts them. They are not declared twice: `DecodingKnobs` is
built from `SamplingConfig`'s own fields, so limits, defaults and descriptions stay in one place
and the HTTP API rejects exactly what the CLI rejects. vLLM's beam-search extension fields are
accepted as vLLM names them (`use_beam_search`, `length_penalty`, `early_stopping`; `n` is the
beam width when `width` is not given), so a vLLM beam-search client works unchanged. OpenAI's
and vLLM's per-beam processors (`frequency_penalty`, `presence_penalty`, `logit_bias`,
`repetition_penalty`, `min_tokens`) are taken as they define them (dsbd_core/algorithm/
penalties.py); OpenAI options dsbd cannot honour (tools, ...) are refused with a message naming
the field, not ignored.

logprobs follow OpenAI's documented ranges: chat `logprobs: true` with `top_logprobs` 0..20
(`top_logprobs` needs `logprobs: true`), completions `logprobs` 0..5 (an integer: the number of
alternatives). The native route takes `logprobs` 0..20 (SamplingConfig.logprobs).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from deployments.api.penalty_fields import LogitBiasField
from deployments.api.stop_fields import EosFields, StopFields
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.methods import BEAM_METHODS, SEARCH_METHODS, Method

# SamplingConfig fields that OpenAI requests carry under their own names, that the server fills,
# or that other fields decide (`search`: `method` or `use_beam_search`; `logprobs`: the routes'
# own logprobs fields).
_OPENAI_NAMED = {
    "temperature",
    "top_p",
    "seed",
    "max_new_tokens",
    "eos_token_ids",
    "search",
    "logprobs",
    "logit_bias",
}

DecodingKnobs: type[BaseModel] = create_model(  # type: ignore[call-overload]  # create_model's overloads miss **fields
    "DecodingKnobs",
    __config__=ConfigDict(extra="forbid"),
    method=(
        Method,
        Field(
            "dsbd",
            description="Decoder: dsbd, beam, sps, sample, beam_search or spec_beam_search.",
        ),
    ),
    use_beam_search=(
        bool,
        Field(
            False,
            description=(
                "vLLM's field: deterministic beam search (the W best candidates each step) with"
                " the given method: beam -> beam_search, dsbd -> spec_beam_search (the same"
                " tokens, fewer target forwards), sample/sps -> greedy. On the OpenAI routes"
                " `n` is then the width when `width` is not given (vLLM: n = beam width)."
            ),
        ),
    ),
    adaptive=(
        bool,
        Field(
            True,
            description=(
                "Let the session registry pick the draft depth and draft width per iteration "
                "(request values are maxima; output law unchanged). false: use them as given, "
                "which with a seed makes the decode reproducible (whatever the batch in float32 "
                "and float64; in bfloat16 or with the int8 draft only when it runs alone)."
            ),
        ),
    ),
    **{
        name: (field.annotation, field)
        for name, field in SamplingConfig.model_fields.items()
        if name not in _OPENAI_NAMED
    },
)
DecodingKnobs.__doc__ = "DSBD knobs as extra body fields (see SamplingConfig for each one)."

# OpenAI fields that are accepted only at their neutral value (anything else is refused).
_NEUTRAL: dict[str, Any] = {
    "best_of": 1,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
}


class _OpenAIRequest(DecodingKnobs, StopFields, EosFields, LogitBiasField):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="A name from /v1/models.")
    max_tokens: int | None = Field(
        None,
        ge=0,
        le=32768,
        description="Tokens to generate at most (0: none, with echo: score the prompt only).",
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description=(
            "0 means deterministic decoding, as in vLLM: greedy for n = 1, beam search of"
            " width n for n > 1 or use_beam_search (speculative with a drafting method)."
        ),
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64, description="How many beams to return, best first (<= width).")
    stream: bool = Field(False, description="Stream the current best beam as server-sent events.")
    stream_options: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=0)
    user: str | None = None
    best_of: int | None = None
    echo: bool = Field(
        False,
        description=(
            "Completions: return the prompt before each choice's text, and with `logprobs` its"
            " tokens' log-probabilities too (the first token's null), from one target forward."
        ),
    )
    suffix: str | None = None

    @model_validator(mode="after")
    def _refuse_what_dsbd_cannot_do(self) -> _OpenAIRequest:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value is not False and value != neutral:
                raise ValueError(
                    f"{name}={value!r} is not supported by dsbd; allowed: {neutral!r} (omit it)"
                )
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens=0 decodes nothing; allowed: max_tokens >= 1, or 0 with"
                " echo=true (scores the prompt only)"
            )
        if self.echo and self.stream:
            raise ValueError("echo=true with stream=true is not supported; allowed: stream=false")
        if self.temperature == 0:  # vLLM: greedy, or beam search when beams are asked for
            self.use_beam_search = True
        if self.use_beam_search and "width" not in self.model_fields_set:
            self.width = self.n  # vLLM: n is the beam width (1: greedy)
        width = self.width
        if self.method in BEAM_METHODS and self.n > width:  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
            raise ValueError(f"n={self.n} is larger than width={width}; allowed: 1 <= n <= width")
        if self.method in ("sample", "sps") and self.n > 1:  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
            raise ValueError(
                f"n={self.n} needs a beam method ({', '.join(BEAM_METHODS)}); {self.method} has 1"  # type: ignore[attr-defined]  # a DecodingKnobs field (create_model)
            )
        return self

    @property
    def logprob_count(self) -> int | None:
        """SamplingConfig.logprobs: the alternatives asked for, None when logprobs are not."""
        raise NotImplementedError

    def sampling_config(
        self, eos_token_ids: tuple[int, ...], max_new_tokens: int
    ) -> SamplingConfig:
        """The SamplingConfig this request asks for (validated once more by SamplingConfig)."""
        return _sampling_config(
            self, self.max_tokens or max_new_tokens, eos_token_ids, self.logprob_count
        )


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ...,
        description=(
            "The prompt: a text, a list of texts, a list of token ids, or a list of such lists"
            " (OpenAI's forms). A list is a batch: every prompt is decoded, its n choices"
            " indexed prompt x n + beam, and usage sums over them."
        ),
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description=(
            "Log-probabilities of the returned tokens and of the `logprobs` most likely tokens"
            " at each position (0..5, OpenAI's range; the target's raw distribution)."
        ),
    )

    @field_validator("logprobs", mode="before")
    @classmethod
    def _count_not_flag(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would read true as 1
            raise ValueError("completions take an integer 0..5 (the alternatives per token)")
        return value

    @field_validator("prompt", mode="after")
    @classmethod
    def _prompts_not_empty(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("an empty prompt; allowed: at least one character")
            return value
        if not value:
            raise ValueError("an empty list; allowed: at least one prompt or token id")
        for i, item in enumerate(value):
            if isinstance(item, int) and item < 0:
                raise ValueError(f"prompt[{i}]={item}: token ids are >= 0")
            if isinstance(item, str | list) and not item:
                raise ValueError(f"prompt[{i}] is empty; allowed: at least one token")
            if isinstance(item, list) and any(t < 0 for t in item):
                bad = next(t for t in item if t < 0)
                raise ValueError(f"prompt[{i}] holds token id {bad}; token ids are >= 0")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, as a text or as token ids (one for a single prompt)."""
        value = self.prompt
        if isinstance(value, str) or all(isinstance(t, int) for t in value):
            return [value]  # type: ignore[list-item]  # the checks above: a text or token ids
        return list(value)  # type: ignore[arg-type]  # the checks above: a list of prompts

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """OpenAI allows content as a list of parts; only text parts can be decoded."""
        if isinstance(value, list):
            texts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError("only text content parts are supported")
                texts.append(str(part.get("text", "")))
            return "".join(texts)
        return value


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    logprobs: bool | None = Field(
        None, description="Log-probabilities of the returned tokens (the target's raw ones)."
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Most likely tokens per position, 0..20 (logprobs: true)."
    )
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.echo:
            raise ValueError("echo=true is a completions field; allowed on chat: false (omit it)")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(
                    f"max_tokens={self.max_tokens} and max_completion_tokens="
                    f"{self.max_completion_tokens} disagree; give one of them"
                )
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(
                f"top_logprobs={self.top_logprobs} needs logprobs=true (got logprobs="
                f"{self.logprobs!r}); allowed: top_logprobs 0..20 with logprobs=true"
            )
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(DecodingKnobs, StopFields, EosFields, LogitBiasField):
    """POST /v1/dsbd/generate: one prompt, all beams and full statistics back."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="A name from /v1/models; default: the first model served."
    )
    prompt: str | None = Field(None, min_length=1, description="Prompt text (or prompt_ids).")
    prompt_ids: list[int] | None = Field(None, min_length=1, description="Prompt token ids.")
    chat: bool = Field(True, description="Wrap `prompt` in the model's chat template.")
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    max_new_tokens: int = Field(64, ge=1, le=32768)
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description=(
            "Every beam's token log-probabilities and the `logprobs` most likely tokens at each"
            " position (0..20; the target's raw distribution, summing to log_likelihood)."
        ),
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        return self

    def sampling_config(self, eos_token_ids: tuple[int, ...]) -> SamplingConfig:
        return _sampling_config(self, self.max_new_tokens, eos_token_ids, self.logprobs)


def _sampling_config(
    request: BaseModel, max_new_tokens: int, eos_token_ids: tuple[int, ...], logprobs: int | None
) -> SamplingConfig:
    """SamplingConfig from a request's knobs plus the fields OpenAI names its own way."""
    knobs = {
        name: getattr(request, name)
        for name in DecodingKnobs.model_fields
        if name not in ("method", "adaptive", "use_beam_search")
    }
    search = request.use_beam_search or request.method in SEARCH_METHODS  # type: ignore[attr-defined]  # a request model's (its create_model bases)
    return SamplingConfig(
        **knobs,
        # 0 (OpenAI routes) decodes deterministically (`search`), where no temperature applies
        temperature=request.temperature or 1.0,  # type: ignore[attr-defined]  # a request model's (its create_model bases)
        top_p=request.top_p,  # type: ignore[attr-defined]  # a request model's (its create_model bases)
        seed=request.seed,  # type: ignore[attr-defined]  # a request model's (its create_model bases)
        max_new_tokens=max_new_tokens,
        eos_token_ids=request.eos_ids(eos_token_ids),  # type: ignore[attr-defined]  # a request model's (its create_model bases)
        search=search,
        logprobs=logprobs,
        logit_bias=request.logit_bias_ids,  # type: ignore[attr-defined]  # a request model's (its create_model bases)
    )


# ------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI completions' logprobs: per token its text, its log-probability, the most likely
    tokens there (text -> log-probability; the chosen one included, as OpenAI does) and where
    its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (no context)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's field: the stop string a finished beam's text was cut at (None: EOS or length)
    stop_reason: int | str | None = None


class _Response(BaseModel):
    """What every OpenAI response object carries besides its id, kind and choices."""

    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    """A token, its log-probability and the UTF-8 bytes of its text (OpenAI chat)."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """A returned token with the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI chat's `choices[i].logprobs`."""

    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None  # as CompletionChoice's


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dsbd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
