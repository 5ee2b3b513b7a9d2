"""OpenAI's and vLLM's per-beam processors over HTTP (issue 52 items 2 and 4): frequency_penalty,
presence_penalty and logit_bias as the `openai` client sends them, repetition_penalty and
min_tokens as extra body fields, on completions and chat, streamed and not, and on the native
route. Every served decode equals the in-process decode with the same fields (`adaptive: false`,
the same seed), differs from the decode without them, and bad values are a 400 naming the
field, the value and what is allowed. The server is the one tests/serving/test_serving_api.py
uses (tests/conftest.py `served`).
"""

from __future__ import annotations

from typing import Any

import pytest
import requests

from deployments.api.responses import BeamText
from dsbd_core.models import load_tokenizer
from tests.support.api_choices import choice_text
from tests.support.serving_harness import MODEL, assert_same, client, in_process_decoder, native

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
KNOBS = {"width": 2, "gamma": 2, "adaptive": False}
DECODE = {"seed": 5, "max_new_tokens": 10, "width": 2, "gamma": 2}
OPENAI = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
VLLM = {"repetition_penalty": 1.8, "min_tokens": 6}


@pytest.fixture(scope="module")
def server(served):
    return served


@pytest.fixture(scope="module")
def reference(server):
    return in_process_decoder(server)


@pytest.fixture(scope="module")
def texts(server) -> BeamText:
    tokenizer, _ = load_tokenizer(str(server["target"]))
    return BeamText(tokenizer)


def _prompt_ids(texts: BeamText, chat: bool) -> list[int]:
    tokenizer = texts.tokenizer
    if not chat:
        return tokenizer.encode("one two")
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _bias(reference, prompt: list[int]) -> dict[int, float]:
    """A bias that moves the decode: the free decode's first token banned, another favoured."""
    free = reference("dsbd", prompt, **DECODE).beams[0].token_ids
    return {free[0]: -100.0, (free[0] + 7) % 50: 2.0}


def _openai(api, chat: bool, stream: bool, bias: dict[int, float]) -> Any:
    common = {"model": MODEL, "max_tokens": 10, "seed": 5, "n": 2, "stream": stream}
    fields = {**OPENAI, "logit_bias": {str(k): v for k, v in bias.items()}}
    extra = {**KNOBS, **VLLM}
    if chat:
        return api.chat.completions.create(messages=MESSAGES, extra_body=extra, **fields, **common)
    return api.completions.create(prompt="one two", extra_body=extra, **fields, **common)


def test_the_native_route_decodes_the_processed_law_as_in_process(server, reference, texts):
    prompt = _prompt_ids(texts, False)
    bias = _bias(reference, prompt)
    fields = {**OPENAI, **VLLM}
    body = {"prompt_ids": prompt, "adaptive": False, **DECODE, **fields}
    got = native(server, {**body, "logit_bias": {str(k): v for k, v in bias.items()}})
    want = reference("dsbd", prompt, logit_bias=bias, **DECODE, **fields)
    assert_same(got, want)
    assert want.beams[0].token_ids != reference("dsbd", prompt, **DECODE).beams[0].token_ids
    assert all(len(b.token_ids) >= VLLM["min_tokens"] for b in want.beams)


@pytest.mark.parametrize("chat", [False, True])
def test_the_openai_routes_take_the_fields_streamed_and_not(server, reference, texts, chat):
    prompt = _prompt_ids(texts, chat)
    bias = _bias(reference, prompt)
    api = client(server)
    whole = _openai(api, chat, False, bias)
    want = reference("dsbd", prompt, logit_bias=bias, **DECODE, **OPENAI, **VLLM)
    got = [choice_text(c, chat) for c in sorted(whole.choices, key=lambda c: c.index)]
    assert got == [texts.text(beam) for beam in want.beams]
    free = reference("dsbd", prompt, **DECODE)
    assert got != [texts.text(beam) for beam in free.beams]  # the fields changed the output
    streamed: dict[int, str] = {}
    for chunk in _openai(api, chat, True, bias):
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            streamed[choice.index] = streamed.get(choice.index, "") + piece
    assert [streamed.get(i, "") for i in range(2)] == got


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        (
            {"frequency_penalty": 2.5},
            "frequency_penalty",
            "frequency_penalty=2.5: Input should be less than or equal to 2",
        ),
        (
            {"presence_penalty": -3},
            "presence_penalty",
            "presence_penalty=-3: Input should be greater than or equal to -2",
        ),
        (
            {"repetition_penalty": 0},
            "repetition_penalty",
            "repetition_penalty=0: Input should be greater than 0",
        ),
        (
            {"min_tokens": -1},
            "min_tokens",
            "min_tokens=-1: Input should be greater than or equal to 0",
        ),
        (
            {"min_tokens": 20, "max_tokens": 10},
            None,
            "min_tokens=20 is larger than max_new_tokens=10",
        ),
        (
            {"logit_bias": {"1000000": 1}},
            "logit_bias",
            "logit_bias['1000000']: token id 1000000 out of range; allowed 0..",
        ),
        ({"logit_bias": {"x": 1}}, "logit_bias", "key 'x' is not a token id"),
        ({"logit_bias": {"3": 200}}, "logit_bias", "allowed: -100 <= bias <= 100"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(server, fields, param, fragment) -> None:
    """On completions, chat and the native route (whose budget is max_new_tokens)."""
    for path, request in (
        ("completions", {"model": MODEL, "prompt": "x"}),
        ("chat/completions", {"model": MODEL, "messages": MESSAGES}),
        ("dsbd/generate", {"prompt_ids": [5, 6]}),
    ):
        body = dict(fields)
        if path == "dsbd/generate" and "max_tokens" in body:
            body["max_new_tokens"] = body.pop("max_tokens")
        response = requests.post(f"{server['url']}/v1/{path}", json={**request, **body}, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert fragment in error["message"], (path, error)
        assert param is None or error["param"] == param, (path, error)
