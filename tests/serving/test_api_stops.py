"""Stop strings in the HTTP layer (issue 52), on SmolLM2's real tokenizer: the returned text
is cut where the stop starts (kept with `include_stop_str_in_output`), `stop_reason` names it,
the log-probs list every token, a stream never sends what the cut removes, and bad stop lists
are refused naming the field. The served end to end test is in test_serving_api.py.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.api.models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from deployments.api.responses import BeamText, completion_response
from deployments.api.streaming import streamable
from dsbd_core.algorithm.sequences.result import Beam
from dsbd_core.models import load_tokenizer

TEXT = "The capital is Berlin.\n\nQuestion: and France?"


@pytest.fixture(scope="module")
def texts() -> BeamText:
    tokenizer, _ = load_tokenizer("smollm2")
    return BeamText(tokenizer)


def _beam(texts: BeamText, text: str, finished: bool) -> Beam:
    ids = texts.tokenizer.encode(text)
    return Beam(token_ids=ids, log_likelihood=-1.0, score=-1.0, finished=finished)


def test_a_beam_finished_at_a_stop_string_is_cut_before_it(texts: BeamText) -> None:
    view = texts.with_stops(["Question:", "\n\n"], False)
    beam = _beam(texts, "The capital is Berlin.\n\n", True)
    assert view.text(beam) == "The capital is Berlin."
    assert view.stop_reason(beam) == "\n\n"
    assert view.visible_ids(beam) == beam.token_ids  # every token: the text is cut instead
    kept = texts.with_stops(["\n\n"], True)
    assert kept.text(beam) == "The capital is Berlin.\n\n"
    # a beam cut at the budget or at EOS is as before: no stop_reason
    running = _beam(texts, "The capital is Berlin.\n\n", False)
    assert view.text(running) == "The capital is Berlin.\n\n" and view.stop_reason(running) is None
    reply = completion_response("m", [1], [beam, running], view, chat=False)
    assert [c.stop_reason for c in reply.choices] == ["\n\n", None]
    assert [c.finish_reason for c in reply.choices] == ["stop", "length"]
    assert texts.with_stops([], False) is texts


def test_a_stream_never_sends_what_a_later_stop_cuts(texts: BeamText) -> None:
    view = texts.with_stops(["Question:", "\n\nQ"], False)
    ids = texts.tokenizer.encode(TEXT)
    final = "The capital is Berlin."
    for n in range(len(ids) + 1):
        sent = streamable(texts.decode(ids[:n]), view)
        assert final.startswith(sent), (n, sent)
    assert streamable(texts.decode(ids), view) == final
    assert streamable("Berlin.\n\nQ", texts.with_stops(["\n\nQ"], True)) == "Berlin.\n\nQ"


def test_bad_stop_lists_are_refused_naming_the_field() -> None:
    for body, fragment in (
        ({"stop": ["a", ""]}, "stop[1]='' is empty"),
        ({"stop": ["x"] * 17}, "17 stop strings; allowed: at most 16"),
        ({"stop": "y" * 300}, "stop[0] is 300 characters; allowed: at most 256"),
    ):
        with pytest.raises(ValidationError, match="stop") as info:
            CompletionRequest(model="m", prompt="p", **body)
        assert fragment in str(info.value)
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stop=["Question:", "\ndef"],
        include_stop_str_in_output=True,
    )
    assert request.stop_strings == ["Question:", "\ndef"] and request.include_stop_str_in_output


def test_stop_token_ids_and_ignore_eos_set_the_ids_that_finish_a_beam(texts: BeamText) -> None:
    """vLLM's `stop_token_ids` add to the model's EOS ids and `ignore_eos` drops those; a beam
    that ends with a requested id has it as `stop_reason` and its text leaves it out."""
    completion = CompletionRequest(model="m", prompt="p", stop_token_ids=[13, 2, 13])
    assert completion.sampling_config((2,), 8).eos_token_ids == (2, 13)
    ignoring = CompletionRequest(model="m", prompt="p", stop_token_ids=[13], ignore_eos=True)
    assert ignoring.sampling_config((2,), 8).eos_token_ids == (13,)
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], ignore_eos=True
    )
    assert chat.sampling_config((2,), 8).eos_token_ids == ()
    assert GenerateRequest(prompt="p", stop_token_ids=[7]).sampling_config((2,)).eos_token_ids == (
        2,
        7,
    )
    ids = texts.tokenizer.encode("The capital is Berlin.")
    view = texts.with_stops([], False, [ids[-1]])
    ended = Beam(token_ids=ids, log_likelihood=-1.0, score=-1.0, finished=True)
    assert view.stop_reason(ended) == ids[-1]
    assert view.text(ended) == texts.decode(ids[:-1])  # the stop token's text left out
    reply = completion_response("m", [1], [ended], view, chat=False)
    assert reply.choices[0].stop_reason == ids[-1] and reply.choices[0].finish_reason == "stop"
    eos = Beam(token_ids=[*ids[:-1], 2], log_likelihood=-1.0, score=-1.0, finished=True)
    assert view.stop_reason(eos) is None  # the model's EOS: no stop_reason, as vLLM


def test_bad_stop_token_ids_and_ignore_eos_are_refused_naming_the_field() -> None:
    for body, fragment in (
        ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]=-1 is negative"),
        ({"stop_token_ids": list(range(17))}, "at most 16 items"),
        ({"ignore_eos": "maybe"}, "valid boolean"),
    ):
        field = next(iter(body))
        for model in (CompletionRequest, GenerateRequest):
            extra = {"model": "m"} if model is CompletionRequest else {}
            with pytest.raises(ValidationError, match=field) as info:
                model(prompt="p", **extra, **body)
            assert fragment in str(info.value)
