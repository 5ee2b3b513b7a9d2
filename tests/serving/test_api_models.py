"""The HTTP API's request/response models, checked against the real `openai` client.

The client talks to an in-memory httpx transport (no socket is opened): what it sends must parse
into our request models, DSBD knobs passed with `extra_body` included, and what we answer must
parse into the client's own response types.
"""

from __future__ import annotations

import json
import re

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest
from pydantic import ValidationError

from deployments.api.models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DecodingKnobs,
    Usage,
)
from dsbd_core import SamplingConfig, config_error_message


def client_for(handler) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        api_key="test",
        base_url="http://127.0.0.1:9/v1",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def test_knobs_are_sampling_config_fields_with_the_same_limits() -> None:
    for name in ("width", "draft_width", "gamma", "threshold", "w_min", "mode", "top_k"):
        ours, theirs = DecodingKnobs.model_fields[name], SamplingConfig.model_fields[name]
        assert (ours.annotation, ours.default, ours.metadata, ours.description) == (
            theirs.annotation,
            theirs.default,
            theirs.metadata,
            theirs.description,
        )
    with pytest.raises(ValidationError) as info:
        CompletionRequest(model="m", prompt="p", width=0)
    assert config_error_message(info.value).startswith("width=0")


def test_openai_completion_request_parses_with_extra_body_knobs() -> None:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        body = CompletionResponse(
            model="smollm2",
            choices=[
                CompletionChoice(index=0, text="Paris.", finish_reason="stop"),
                CompletionChoice(index=1, text="Paris", finish_reason="length"),
            ],
            usage=Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8),
        )
        return httpx.Response(200, json=body.model_dump())

    client = client_for(handler)
    answer = client.completions.create(
        model="smollm2",
        prompt="The capital of France is",
        max_tokens=8,
        n=2,
        seed=3,
        temperature=0.8,
        extra_body={"width": 3, "gamma": 2, "threshold": None, "method": "dsbd"},
    )
    request = CompletionRequest.model_validate(seen)
    config = request.sampling_config(eos_token_ids=(2,), max_new_tokens=64)
    assert (config.width, config.gamma, config.threshold, config.max_new_tokens) == (3, 2, None, 8)
    assert (config.seed, config.temperature, request.n) == (3, 0.8, 2)
    assert [c.text for c in answer.choices] == ["Paris.", "Paris"]
    assert answer.usage is not None and answer.usage.total_tokens == 8


def test_openai_chat_request_parses_and_response_is_understood() -> None:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        body = ChatCompletionResponse(
            model="smollm2",
            choices=[
                ChatChoice(index=0, message=AssistantMessage(content="Hi!"), finish_reason="stop")
            ],
        )
        return httpx.Response(200, json=body.model_dump())

    answer = client_for(handler).chat.completions.create(
        model="smollm2",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        extra_body={"lean_memory": True},
    )
    request = ChatCompletionRequest.model_validate(seen)
    assert request.max_tokens == 5 and request.lean_memory  # type: ignore[attr-defined]
    assert [m.role for m in request.messages] == ["system", "user"]
    assert answer.choices[0].message.content == "Hi!"


@pytest.mark.parametrize(
    ("field", "value"),
    [("best_of", 3), ("suffix", "s")],
)
def test_options_dsbd_cannot_honour_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest(model="m", prompt="p", **{field: value})
    assert f"{field}={value!r} is not supported" in str(info.value)


def test_the_processor_fields_reach_the_config_and_bad_ones_name_the_field() -> None:
    """OpenAI's and vLLM's per-beam processors (dsbd_core/algorithm/sequences/penalties.py)."""
    fields = {
        "frequency_penalty": 0.5,
        "presence_penalty": -1.0,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "logit_bias": {"5": 1.0, "7": -100},
    }
    config = CompletionRequest(model="m", prompt="p", **fields).sampling_config((0,), 16)
    assert config.logit_bias == ((5, 1.0), (7, -100.0)) and config.min_tokens == 3
    assert (config.frequency_penalty, config.presence_penalty) == (0.5, -1.0)
    assert config.repetition_penalty == 1.2
    for field, value, allowed in (
        ("frequency_penalty", 2.5, "less than or equal to 2"),
        ("presence_penalty", -2.5, "greater than or equal to -2"),
        ("repetition_penalty", 0, "greater than 0"),
        ("min_tokens", -1, "greater than or equal to 0"),
        ("logit_bias", {"x": 1.0}, "key 'x' is not a token id"),
        ("logit_bias", {"5": 100.5}, "allowed: -100 <= bias <= 100"),
        ("logit_bias", {str(i): 1.0 for i in range(301)}, "301 entries; allowed: at most 300"),
    ):
        with pytest.raises(ValidationError) as info:
            ChatCompletionRequest(
                model="m", messages=[{"role": "user", "content": "x"}], **{field: value}
            )
        assert field in str(info.value) and allowed in str(info.value), str(info.value)


def test_echo_scores_completions_only_and_max_tokens_zero_needs_it() -> None:
    request = CompletionRequest(model="m", prompt=[1, 2, 3], echo=True, logprobs=1, max_tokens=0)
    assert request.echo and request.max_tokens == 0
    with pytest.raises(ValidationError, match="max_tokens=0 decodes nothing"):
        CompletionRequest(model="m", prompt="p", max_tokens=0)
    with pytest.raises(ValidationError, match="echo=true with stream=true"):
        CompletionRequest(model="m", prompt="p", echo=True, stream=True)
    with pytest.raises(ValidationError, match="echo=true is a completions field"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], echo=True)


def test_n_is_bounded_by_the_width_and_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="n=4 is larger than width=3"):
        CompletionRequest(model="m", prompt="p", n=4, width=3)
    with pytest.raises(ValidationError, match="needs a beam method"):
        CompletionRequest(model="m", prompt="p", n=2, method="sample")
    with pytest.raises(ValidationError, match="beams"):
        CompletionRequest(model="m", prompt="p", beams=3)


@pytest.mark.parametrize(("extra", "width"), [({}, 1), ({"n": 3}, 3), ({"n": 2, "width": 4}, 4)])
def test_temperature_zero_decodes_deterministically_as_vllm(extra: dict, width: int) -> None:
    """temperature 0: greedy for n = 1, beam search of width n (or the given width) for more."""
    for kind, body in (
        (CompletionRequest, {"prompt": "x"}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        request = kind(model="m", temperature=0, **body, **extra)
        config = request.sampling_config((0,), 16)
        assert config.search and config.width == width and config.temperature == 1.0
    sampled = CompletionRequest(model="m", prompt="x", temperature=0.5)
    assert not sampled.sampling_config((0,), 16).search


def test_completion_prompts_take_openai_forms() -> None:
    """A text, texts, token ids, lists of token ids (OpenAI's completions API); empty ones and
    negative ids are refused naming where they stand."""
    forms = [
        ("x", ["x"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ]
    for prompt, prompts in forms:
        assert CompletionRequest(model="m", prompt=prompt).prompts == prompts
    for bad, fragment in (
        ("", "empty prompt"),
        ([], "empty list"),
        ([[]], "prompt[0] is empty"),
        ([3, -1], "prompt[1]=-1"),
        ([[1], [2, -4]], "token id -4"),
    ):
        with pytest.raises(ValidationError, match=re.escape(fragment)):
            CompletionRequest(model="m", prompt=bad)
