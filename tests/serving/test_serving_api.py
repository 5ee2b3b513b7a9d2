"""Issue 20 over HTTP with the real `openai` client: logprobs (chat and completions, n = 2,
streamed and not) and vLLM's beam-search fields, on `dsbd serve` with the tiny float64 pair;
and the model replicas' allocator (issue 21).

The server tests/serving/test_serving.py uses too (tests/conftest.py `served`, serving_harness);
every served value is compared with the in-process engine's for the same seed (`adaptive:
false`), as the other distributed-decode tests do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from deployments.api.responses import BeamText
from deployments.replicas.allocator import jemalloc_library
from dsbd.server_process import descendants, process_name
from dsbd_core.models import load_tokenizer
from tests.support.api_choices import choice_text, per_choice, stop_case
from tests.support.serving_harness import MODEL, assert_same, client, in_process_decoder, native

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
KNOBS = {"width": 2, "gamma": 2, "adaptive": False}


@pytest.fixture(scope="module")
def server(served):
    """The `dsbd serve` this module shares with another (tests/conftest.py `served`)."""
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


def _request(api, chat: bool, stream: bool, **extra: Any):
    # seed 5: both beams say something on both routes (with the hashed draws, seed 4's second
    # beam ends at once, and an empty beam checks nothing)
    common = {"model": MODEL, "max_tokens": 10, "seed": 5, "n": 2, "stream": stream, **extra}
    if chat:
        return api.chat.completions.create(
            messages=MESSAGES, logprobs=True, top_logprobs=3, extra_body=KNOBS, **common
        )
    return api.completions.create(prompt="one two", logprobs=3, extra_body=KNOBS, **common)


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_equal_the_in_process_decode_streamed_and_not(server, reference, texts, chat):
    api = client(server)
    whole = _request(api, chat, False)
    want = reference(
        "dsbd", _prompt_ids(texts, chat), seed=5, max_new_tokens=10, logprobs=3, width=2, gamma=2
    )
    assert len(whole.choices) == 2
    for choice, beam in zip(whole.choices, want.beams, strict=True):
        visible = texts.visible_ids(beam)
        assert visible, "an empty beam checks nothing"
        if chat:
            content = choice.logprobs.content
            assert [c.token for c in content] == [texts.piece(t) for t in visible]
            got = [c.logprob for c in content]
            tops = [[t.token for t in c.top_logprobs] for c in content]
        else:
            assert choice.logprobs.tokens == [texts.piece(t) for t in visible]
            got = choice.logprobs.token_logprobs
            tops = [list(top) for top in choice.logprobs.top_logprobs]
            assert choice.logprobs.text_offset[0] == 0
        assert got == pytest.approx(beam.token_logprobs[: len(visible)], abs=1e-9)
        for top, alternatives, token in zip(tops, beam.top_logprobs, visible, strict=False):
            expected = [texts.piece(t) for t, _ in alternatives]
            if not chat:  # OpenAI completions: the chosen token is listed too
                expected.append(texts.piece(token))
            assert sorted(set(top)) == sorted(set(expected))
    # streamed: each chunk carries the logprobs of the tokens it adds; together, the same
    streamed = per_choice(list(_request(api, chat, True)), chat)
    expected = per_choice([whole], chat)
    assert sorted(streamed) == sorted(expected) == [0, 1]
    for index, entries in expected.items():
        assert [(t, top) for t, _, top in streamed[index]] == [(t, top) for t, _, top in entries]
        assert [p for _, p, _ in streamed[index]] == pytest.approx([p for _, p, _ in entries])


@pytest.mark.parametrize("chat", [False, True])
def test_stop_strings_end_beams_as_in_process_streamed_and_not(server, reference, texts, chat):
    """Issue 52: a stop string of several tokens that the decode meets midway ends the beam
    there, as in the in-process decode with the same stop; the text ends before it, and the
    streamed text is the same (nothing sent that the stop cut)."""
    prompt = _prompt_ids(texts, chat)
    knobs, candidate, want, view = stop_case(server, reference, texts, prompt)
    api = client(server)
    seed = {"seed": knobs["seed"]}
    whole = _request(api, chat, False, stop=[candidate], **seed)
    assert len(whole.choices) == len(want.beams) == 2
    for choice, beam in zip(whole.choices, want.beams, strict=True):
        assert choice_text(choice, chat) == view.text(beam)
        assert candidate not in choice_text(choice, chat)
        assert choice.finish_reason == ("stop" if beam.finished else "length")
        assert choice.model_dump().get("stop_reason") == view.stop_reason(beam)
    assert any(c.model_dump().get("stop_reason") == candidate for c in whole.choices)
    streamed: dict[int, str] = {}
    for chunk in _request(api, chat, True, stop=[candidate], **seed):
        for choice in chunk.choices:
            part = choice.delta.content if chat else choice.text
            streamed[choice.index] = streamed.get(choice.index, "") + (part or "")
    assert streamed == {i: choice_text(c, chat) for i, c in enumerate(whole.choices)}


def test_the_native_route_takes_stop_strings_as_the_openai_routes(server, reference, texts) -> None:
    """`stop` and `include_stop_str_in_output` on /v1/dsbd/generate: the beams are the
    in-process decode's with the same stop, each text cut before it (or through it) and
    `stop_reason` naming it; a bad stop list is a 400 naming `stop`."""
    prompt = _prompt_ids(texts, False)
    knobs, candidate, want, view = stop_case(server, reference, texts, prompt)
    body = {"prompt_ids": prompt, "stop": [candidate], "adaptive": False, **knobs}
    got = native(server, body)
    assert_same(got, want)
    for served, beam in zip(got["beams"], want.beams, strict=True):
        assert served["text"] == view.text(beam) and candidate not in served["text"]
        assert served["stop_reason"] == view.stop_reason(beam)
    assert any(b["stop_reason"] == candidate for b in got["beams"])
    kept = native(server, {**body, "include_stop_str_in_output": True})
    for served, beam in zip(kept["beams"], want.beams, strict=True):
        if served["stop_reason"] is not None:
            assert served["text"].endswith(candidate), served["text"]
            assert served["text"] == view.text(beam) + candidate
    for stop, fragment in (
        (["one", ""], "stop[1]='' is empty"),
        (["x"] * 17, "17 stop strings; allowed: at most 16"),
    ):
        response = requests.post(
            f"{server['url']}/v1/dsbd/generate",
            json={"prompt_ids": prompt, "stop": stop},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert fragment in error["message"] and error["param"] == "stop", error


def test_stop_token_ids_and_ignore_eos_decode_as_in_process(server, reference, texts) -> None:
    """vLLM's `stop_token_ids` (a token from the middle of a decode) finish beams as the
    in-process decode with that id among the EOS ids, on the native route and on completions
    (streamed and not: the same text, `stop_reason` the id); with `ignore_eos` the id alone
    finishes beams; an id outside the vocabulary or negative is a 400 naming the field."""
    prompt = _prompt_ids(texts, False)
    _, eos = load_tokenizer(str(server["target"]))
    knobs = {"seed": 5, "max_new_tokens": 10, "width": 2, "gamma": 2}
    free = reference("dsbd", prompt, **knobs).beams[0].token_ids

    def ends(token: int, ids: tuple[int, ...]) -> Any:
        want = reference("dsbd", prompt, eos_token_ids=ids, **knobs)
        return want if any(b.finished and b.token_ids[-1] == token for b in want.beams) else None

    token = next(t for t in free[1:-1] if t not in eos and ends(t, (*eos, t)))
    want = ends(token, (*eos, token))
    body = {"prompt_ids": prompt, "stop_token_ids": [token], "adaptive": False, **knobs}
    got = native(server, body)
    assert_same(got, want)
    view = texts.with_stops([], False, [token])
    assert [b["stop_reason"] for b in got["beams"]] == [view.stop_reason(b) for b in want.beams]
    assert token in [b["stop_reason"] for b in got["beams"]]
    extra = {**KNOBS, "stop_token_ids": [token]}
    common = {"model": MODEL, "prompt": "one two", "max_tokens": 10, "n": 2, "seed": 5}
    api = client(server)
    whole = api.completions.create(extra_body=extra, **common)
    for choice, beam in zip(whole.choices, want.beams, strict=True):
        assert choice.text == view.text(beam)
        assert choice.model_dump().get("stop_reason") == view.stop_reason(beam)
    streamed: dict[int, str] = {}
    for chunk in api.completions.create(extra_body=extra, stream=True, **common):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.text or "")
    assert streamed == {c.index: c.text for c in whole.choices}
    alone = reference("dsbd", prompt, eos_token_ids=(token,), **knobs)
    assert_same(native(server, {**body, "ignore_eos": True}), alone)
    for ids, fragment in (
        ([10**6], "stop_token_ids[0]=1000000: token id out of range; allowed 0.."),
        ([-1], "stop_token_ids[0]=-1 is negative"),
    ):
        for path, request in (
            ("dsbd/generate", {"prompt_ids": prompt}),
            ("completions", {"model": MODEL, "prompt": "x"}),
        ):
            response = requests.post(
                f"{server['url']}/v1/{path}",
                json={**request, "stop_token_ids": ids},
                timeout=60,
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert fragment in error["message"] and error["param"] == "stop_token_ids", error


def test_the_native_route_returns_every_tokens_logprob_summing_to_the_log_likelihood(
    server, reference
) -> None:
    body = {
        "prompt_ids": [5, 17, 42],
        "seed": 3,
        "max_new_tokens": 12,
        "logprobs": 2,
        "method": "dsbd",
        "width": 3,
        "gamma": 2,
        "adaptive": False,
    }
    got = native(server, body)
    want = reference("dsbd", [5, 17, 42], seed=3, max_new_tokens=12, logprobs=2, width=3, gamma=2)
    for served, beam in zip(got["beams"], want.beams, strict=True):
        assert served["token_ids"] == beam.token_ids
        assert served["token_logprobs"] == pytest.approx(beam.token_logprobs, abs=1e-9)
        assert sum(served["token_logprobs"]) == pytest.approx(served["log_likelihood"], abs=1e-9)
        assert [[t["token_id"] for t in top] for top in served["top_logprobs"]] == [
            [t for t, _ in top] for top in beam.top_logprobs
        ]


@pytest.mark.parametrize("method", [None, "beam"])
def test_a_vllm_beam_search_client_works_unchanged(server, reference, texts, method) -> None:
    """`use_beam_search` with n = 2 (the width, as vLLM), length_penalty and the default
    method (speculative) or `beam` (plain): the same beams as the in-process beam search."""
    extra: dict[str, Any] = {"use_beam_search": True, "length_penalty": 0.7}
    if method:
        extra["method"] = method
    api = client(server)
    completion = api.completions.create(
        model=MODEL, prompt="one two", max_tokens=12, n=2, extra_body=extra
    )
    want = reference(
        "beam_search", _prompt_ids(texts, False), width=2, length_penalty=0.7, max_new_tokens=12
    )
    assert [c.text for c in completion.choices] == [texts.text(b) for b in want.beams]
    chat = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, n=2, logprobs=True, extra_body=extra
    )
    want = reference(
        "beam_search",
        _prompt_ids(texts, True),
        width=2,
        length_penalty=0.7,
        max_new_tokens=12,
        logprobs=0,
    )
    assert [c.message.content for c in chat.choices] == [texts.text(b) for b in want.beams]
    for choice, beam in zip(chat.choices, want.beams, strict=True):
        visible = texts.visible_ids(beam)
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
            beam.token_logprobs[: len(visible)], abs=1e-9
        )
    stream = api.completions.create(
        model=MODEL, prompt="one two", max_tokens=12, n=2, stream=True, extra_body=extra
    )
    texts_streamed: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts_streamed[c.index] = texts_streamed.get(c.index, "") + c.text
    assert texts_streamed == {i: c.text for i, c in enumerate(completion.choices)}


def test_speculative_search_matches_plain_with_fewer_target_forwards(server) -> None:
    body = {
        "prompt_ids": [5, 17, 42, 99],
        "max_new_tokens": 16,
        "width": 3,
        "gamma": 3,
        "adaptive": False,
    }
    plain = native(server, {**body, "method": "beam_search"})
    speculative = native(server, {**body, "method": "spec_beam_search"})
    tokens = [b["token_ids"] for b in plain["beams"]]
    assert [b["token_ids"] for b in speculative["beams"]] == tokens
    assert plain["stats"]["target_forward_passes"] == plain["stats"]["tokens_emitted"]
    print(
        "served beam search, W=3, 16 tokens: target forwards plain "
        f"{plain['stats']['target_forward_passes']}, speculative "
        f"{speculative['stats']['target_forward_passes']}"
    )


def test_transformers_law_is_served_and_reproducible(server) -> None:
    """selection='transformers' as an extra body field: beam and DSBD (through the draft and
    verifier deployments), seeded decodes the same twice."""
    body = {
        "prompt_ids": [5, 17, 42, 99],
        "max_new_tokens": 12,
        "width": 3,
        "gamma": 2,
        "seed": 7,
        "selection": "transformers",
        "adaptive": False,
    }
    for method in ("beam", "dsbd"):
        first = native(server, {**body, "method": method})
        again = native(server, {**body, "method": method})
        tokens = [b["token_ids"] for b in first["beams"]]
        assert len(tokens) == 3 and tokens == [b["token_ids"] for b in again["beams"]], method


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        (
            "completions",
            {"prompt": "x", "selection": "transformers", "threshold": 0.7},
            "threshold=0.7 does not apply under selection='transformers'",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "top_logprobs": 2},
            "top_logprobs=2 needs logprobs=true",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30},
            "top_logprobs=30",
        ),
        ("completions", {"prompt": "x", "logprobs": 9}, "logprobs=9"),
        (
            "completions",
            {"prompt": "x", "use_beam_search": True, "n": 3, "width": 2},
            "n=3 is larger than width=2",
        ),
        (
            "completions",
            {"prompt": "x", "use_beam_search": True, "early_stopping": "soon"},
            "early_stopping",
        ),
    ],
)
def test_bad_logprob_and_beam_search_fields_get_400(server, path, body, fragment) -> None:
    response = requests.post(
        f"{server['url']}/v1/{path}", json={"model": MODEL, **body}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_every_replica_runs_with_jemalloc(server) -> None:
    """The draft and verifier processes get Ray's jemalloc preloaded
    (deployments/replicas/allocator.py: glibc's malloc kept RSS steps for every new batch shape)
    and capped matmul primitive caches, and report jemalloc's statistics; so do the ingress and
    router (`AppArgs.allocator`: under glibc the ingress's RSS climbed for minutes and dropped at
    once), and Serve's controller and proxy run on it too."""
    status = requests.get(f"{server['url']}/v1/dsbd/status", timeout=30).json()
    assert jemalloc_library() is not None  # the Ray wheel ships it
    for side in ("draft", "verifier"):
        assert status[side]["allocator"] == "jemalloc", status[side]
        maps = Path(f"/proc/{status[side]['pid']}/maps").read_text()
        assert "libjemalloc" in maps
        assert status[side]["primitive_cache"] == 128  # both matmul caches capped (allocator.py)
        stats = status[side]["allocator_stats"]  # jemalloc's own statistics, for the soak
        assert 0 < stats["allocated"] <= stats["active"] <= stats["resident"], stats
    for side in ("router", "ingress"):
        assert status[side]["allocator"] == "jemalloc", status[side]
        assert "libjemalloc" in Path(f"/proc/{status[side]['pid']}/maps").read_text()
        stats = status[side]["allocator_stats"]
        assert 0 < stats["allocated"] <= stats["active"] <= stats["resident"], stats
    # Serve's controller and the proxy it starts (allocator.serve_controller_options): the
    # proxy's glibc arena was the last process to creep in the 30-minute soaks
    if server["pid"] is None:  # a server given from outside: its processes are not ours to read
        return
    wanted = ("ray::ProxyActor", "ray::ServeController")
    names = {pid: process_name(title) for pid, title in descendants(server["pid"]).items()}
    serve_processes = {pid: name for pid, name in names.items() if name in wanted}
    assert sorted(serve_processes.values()) == ["ray::ProxyActor", "ray::ServeController"]
    for pid, name in serve_processes.items():
        assert "libjemalloc" in Path(f"/proc/{pid}/maps").read_text(), name


def test_completions_take_prompt_batches_and_token_ids(server) -> None:
    """OpenAI's prompt forms through the openai client: a text, its token ids, a batch of
    texts, a batch of token-id lists; choices indexed prompt x n + beam; usage summed."""
    tokenizer, _ = load_tokenizer(str(server["target"]))
    ids = tokenizer.encode("one two")
    common = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    text = client(server).completions.create(prompt="one two", **common)
    by_ids = client(server).completions.create(prompt=ids, **common)
    assert by_ids.choices[0].text == text.choices[0].text
    batch = client(server).completions.create(prompt=["one two", "three"], n=2, **common)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt x n + beam
    nested = client(server).completions.create(prompt=[ids, ids], **common)
    assert [c.text for c in nested.choices] == [text.choices[0].text] * 2
    assert nested.usage.prompt_tokens == 2 * len(ids)
    for body, fragment in (
        ({"prompt": [[1, 2], [3, 10**6]]}, "prompt[1][1]=1000000"),
        ({"prompt": ["a", "b"], "stream": True}, "stream=true"),
    ):
        response = requests.post(
            f"{server['url']}/v1/completions", json={"model": MODEL, **body}, timeout=60
        )
        assert response.status_code == 400 and fragment in response.text, response.text


def test_temperature_zero_is_greedy_or_beam_search(server) -> None:
    """vLLM's meaning: temperature 0 decodes deterministically, greedy for n = 1 and beam
    search of width n for more, without a seed."""
    texts = []
    for n in (1, 1, 3):
        completion = client(server).completions.create(
            model=MODEL, prompt="one two", max_tokens=8, temperature=0, n=n
        )
        texts.append([c.text for c in completion.choices])
    assert texts[0] == texts[1] and len(texts[2]) == 3


def test_echo_scores_the_prompt_as_an_independent_forward_does(server) -> None:
    """`echo` with `logprobs` (lm-evaluation-harness's loglikelihood request): the prompt's
    text and tokens' log-probabilities (the first null) from the target, equal to a plain
    forward of its weights; `max_tokens: 0` scores only, `max_tokens: 1` appends the decoded
    token (greedy at temperature 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer, _ = load_tokenizer(str(server["target"]))
    ids = tokenizer.encode("one two three four five")
    model = AutoModelForCausalLM.from_pretrained(str(server["target"]), dtype=torch.float64)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    chosen = expected.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    api = client(server)
    only = api.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], echo=True, logprobs=2, max_tokens=0
    )
    assert [c.index for c in only.choices] == [0, 1]
    first = only.choices[0]
    assert first.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    assert (
        max(abs(a - b) for a, b in zip(first.logprobs.token_logprobs[1:], chosen, strict=True))
        < 1e-9
    )
    assert all(len(top) >= 2 for top in first.logprobs.top_logprobs[1:])
    prefix = only.choices[1].logprobs.token_logprobs[1:]  # scored alone: the same up to last bits
    assert (
        max(abs(a - b) for a, b in zip(prefix, first.logprobs.token_logprobs[1:3], strict=True))
        < 1e-9
    )
    assert only.usage.prompt_tokens == len(ids) + 3 and only.usage.completion_tokens == 0
    more = api.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = more.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1  # the generated token, a stop token too
    assert lp.token_logprobs[: len(ids)] == first.logprobs.token_logprobs
    assert more.choices[0].text.startswith(first.text)
    for path, body, fragment in (
        ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens=0"),
        ("completions", {"prompt": "a", "echo": True, "stream": True}, "echo=true with stream"),
        ("chat/completions", {"messages": MESSAGES, "echo": True}, "echo=true is a completions"),
    ):
        response = requests.post(
            f"{server['url']}/v1/{path}", json={"model": MODEL, **body}, timeout=60
        )
        assert response.status_code == 400 and fragment in response.text, response.text
