"""The HTTP side of issue 20 without a server: the request fields (OpenAI logprobs, vLLM's beam
search extension) and their 400s, and the OpenAI logprobs formats the real `openai` client reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest
from pydantic import ValidationError

from deployments.api.errors import requested_config
from deployments.api.models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from deployments.api.responses import BeamText, completion_response
from dsbd_core.algorithm.sequences.result import Beam
from dsbd_core.models import load_tokenizer
from tests.support.tiny_models import build_tokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _error(kind: type, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        kind.model_validate(body)  # type: ignore[attr-defined]
    return str(info.value)


def test_logprob_fields_map_to_the_config_and_follow_openai_ranges() -> None:
    chat = ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 20})
    assert chat.sampling_config((2,), 16).logprobs == 20
    plain = ChatCompletionRequest.model_validate({**CHAT, "logprobs": True})
    assert plain.sampling_config((2,), 16).logprobs == 0  # the tokens' own, no alternatives
    assert ChatCompletionRequest.model_validate(CHAT).sampling_config((2,), 16).logprobs is None
    completion = CompletionRequest(model="m", prompt="p", logprobs=5)
    assert completion.sampling_config((2,), 16).logprobs == 5
    native = GenerateRequest(prompt_ids=[1, 2], logprobs=7)
    assert native.sampling_config((2,)).logprobs == 7


@pytest.mark.parametrize(
    ("model", "body", "fragment"),
    [
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 3}, "top_logprobs=3 needs logprobs=true"),
        (ChatCompletionRequest, {**CHAT, "logprobs": False, "top_logprobs": 2}, "logprobs=False"),
        (ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CompletionRequest, {"model": "m", "prompt": "p", "logprobs": 6}, "equal to 5"),
        (CompletionRequest, {"model": "m", "prompt": "p", "logprobs": True}, "integer 0..5"),
        (GenerateRequest, {"prompt_ids": [1], "logprobs": 21}, "less than or equal to 20"),
        (
            CompletionRequest,
            {"model": "m", "prompt": "p", "use_beam_search": True, "n": 3, "width": 2},
            "n=3 is larger than width=2",
        ),
        (
            CompletionRequest,
            {"model": "m", "prompt": "p", "method": "beam_search", "n": 4, "width": 3},
            "n=4 is larger than width=3",
        ),
        (
            CompletionRequest,
            {"model": "m", "prompt": "p", "early_stopping": "sometimes"},
            "early_stopping",
        ),
        (CompletionRequest, {"model": "m", "prompt": "p", "method": "greedy"}, "method"),
    ],
)
def test_bad_fields_are_refused_naming_field_value_and_what_is_allowed(model, body, fragment):
    assert fragment in _error(model, body)


def test_vllm_beam_search_fields_make_a_search_config() -> None:
    """vLLM's extension fields: use_beam_search, n as the beam width, length_penalty,
    early_stopping; the method decides plain or speculative."""
    request = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "p",
            "n": 3,
            "use_beam_search": True,
            "length_penalty": 0.6,
            "early_stopping": "never",
        }
    )
    config = request.sampling_config((2,), 16)
    assert (config.search, config.width, config.length_penalty) == (True, 3, 0.6)
    assert config.early_stopping == "never" and request.method == "dsbd"  # speculative
    explicit = CompletionRequest(model="m", prompt="p", n=2, width=4, use_beam_search=True)
    assert explicit.sampling_config((2,), 16).width == 4  # n <= width: the top n of 4
    sampling = CompletionRequest(model="m", prompt="p", n=2, width=2)
    assert not sampling.sampling_config((2,), 16).search
    named = GenerateRequest(prompt_ids=[1], method="beam_search", width=2)
    assert named.sampling_config((2,)).search
    with pytest.raises(Exception) as info:  # an invalid combination is the client's 400
        requested_config(
            lambda: CompletionRequest(
                model="m", prompt="p", use_beam_search=True, n=2, w_min=3
            ).sampling_config((2,), 16)
        )
    assert "w_min=3 is larger than width=2" in str(info.value)


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> BeamText:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    tokenizer, _ = load_tokenizer(str(directory))
    return BeamText(tokenizer)


def _beam(texts: BeamText, words: str, finished: bool) -> Beam:
    ids = texts.tokenizer.encode(words, add_special_tokens=False)
    eos = texts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids + [eos] if finished else ids
    chosen = [-0.5 - i / 10 for i in range(len(ids))]
    tops = [[(ids[i], chosen[i]), (3, -2.0 - i)] for i in range(len(ids))]
    return Beam(ids, sum(chosen), finished, sum(chosen) / len(ids), chosen, tops)


def _client(body: dict) -> openai.OpenAI:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
    return openai.OpenAI(
        api_key="k",
        base_url="http://127.0.0.1:9/v1",
        max_retries=0,
        http_client=httpx.Client(transport=transport),
    )


def test_the_openai_client_reads_both_formats(texts: BeamText) -> None:
    beams = [_beam(texts, "one two three", True), _beam(texts, "The quick", False)]
    chat = completion_response("m", [1, 2], beams, texts, chat=True).model_dump()
    answer = _client(json.loads(json.dumps(chat))).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
    )
    for choice, beam in zip(answer.choices, beams, strict=True):
        content = choice.logprobs.content
        visible = texts.visible_ids(beam)  # the stop token is left out, as from the text
        assert [c.token for c in content] == [texts.piece(t) for t in visible]
        assert [c.logprob for c in content] == beam.token_logprobs[: len(visible)]
        assert "".join(c.token for c in content) == choice.message.content
        assert all(c.bytes == list(c.token.encode()) for c in content)
        assert [len(c.top_logprobs) for c in content] == [2] * len(visible)
    completion = completion_response("m", [1, 2], beams, texts, chat=False).model_dump()
    answer = _client(json.loads(json.dumps(completion))).completions.create(
        model="m", prompt="x", logprobs=2
    )
    for choice, beam in zip(answer.choices, beams, strict=True):
        logprobs = choice.logprobs
        visible = texts.visible_ids(beam)
        assert logprobs.tokens == [texts.piece(t) for t in visible]
        assert logprobs.token_logprobs == beam.token_logprobs[: len(visible)]
        offsets = [len(texts.decode(visible[:i])) for i in range(len(visible))]
        assert logprobs.text_offset == offsets
        tops = zip(visible, logprobs.top_logprobs, strict=True)
        assert all(texts.piece(t) in top for t, top in tops)
        assert choice.text == "".join(logprobs.tokens)
