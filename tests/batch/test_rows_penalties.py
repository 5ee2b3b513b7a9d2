"""The per-beam processors in `dsbd batch` (issue 52 item 2), without Ray: a row takes
min_tokens, the penalties and logit_bias (a JSON object, as on the HTTP routes) as knobs, a bad
one is the row's error naming the field, and the lockstep decoder that runs the rows decodes
each request with its own processors exactly as `generate` does alone."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deployments.batch_job.rows import parse_row
from dsbd_core import SamplingConfig, generate
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import noisy_copy, random_llama

ROW = {
    "prompt_ids": [3, 1],
    "min_tokens": 2,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.4,
    "logit_bias": {"2": -100, "4": 1.5},
}


def test_a_row_takes_the_processor_fields_as_knobs() -> None:
    knobs = parse_row(json.dumps(ROW)).knobs()
    config = SamplingConfig(**knobs)
    assert config.logit_bias == ((2, -100.0), (4, 1.5)) and config.min_tokens == 2
    assert (config.frequency_penalty, config.presence_penalty, config.repetition_penalty) == (
        0.5,
        -0.5,
        1.4,
    )
    for field, value, fragment in (
        ("logit_bias", {"a": 1}, "key 'a' is not a token id"),
        ("logit_bias", {"1": -101}, "allowed: -100 <= bias <= 100"),
        ("presence_penalty", 2.1, "less than or equal to 2"),
    ):
        with pytest.raises(ValidationError) as info:
            parse_row(json.dumps({**ROW, field: value}))
        assert field in str(info.value) and fragment in str(info.value)


def test_lockstep_requests_decode_their_own_processors_as_alone() -> None:
    target = random_llama(1, eos_boost=1.5)
    draft = noisy_copy(target, 0.2)
    fields = {k: v for k, v in ROW.items() if k != "prompt_ids"}
    base = {"max_new_tokens": 6, "eos_token_ids": (0,), "seed": 2, "width": 2}
    requests = [
        Request([3, 1], SamplingConfig(**base, **fields), "dsbd"),
        Request([3, 1], SamplingConfig(**base), "dsbd"),
        Request([5], SamplingConfig(**base, repetition_penalty=3.0), "beam_search"),
        Request([5, 2], SamplingConfig(**{**base, "width": 1}, min_tokens=4), "sps"),
    ]
    results, _ = decode_lockstep(
        requests,
        SessionBatcher(TransformerScorer(target)),
        SessionBatcher(TransformerScorer(draft)),
    )
    for request, got in zip(requests, results, strict=True):
        assert got.error is None and got.result is not None, got.error
        want = generate(
            request.method,
            TransformerScorer(target),
            request.prompt_ids,
            request.config,
            TransformerScorer(draft),
        )
        assert [b.token_ids for b in got.result.beams] == [b.token_ids for b in want.beams]
    banned = [b.token_ids for b in results[0].result.beams]  # type: ignore[union-attr]
    assert all(2 not in ids and 0 not in ids[:2] for ids in banned)
    bad = Request([3], SamplingConfig(logit_bias={99: 1.0}), "beam")
    (failed,), _ = decode_lockstep([bad], SessionBatcher(TransformerScorer(target)))
    assert "logit_bias: token id 99 is outside the vocabulary; allowed: 0..23" in str(failed.error)


def test_a_row_with_a_bias_key_outside_the_vocabulary_is_an_invalid_row(tmp_path) -> None:
    """The actor refuses it before decoding, worded as the HTTP API's 400; a good row with
    the processors becomes a request carrying them."""
    from deployments.batch_job.decoder import BatchDecoder
    from tests.support.tiny_models import build_pair

    target_dir, draft_dir = build_pair(tmp_path)
    decoder = BatchDecoder(
        {
            "target": str(target_dir),
            "draft": str(draft_dir),
            "dtype": "float32",
            "fixed_knobs": True,
        }
    )
    vocab = decoder.vocab_size
    row = {"prompt_ids": [5, 6], "logit_bias": {str(vocab): 1.0}}
    with pytest.raises(ValueError, match=rf"logit_bias: token id {vocab} is outside the"):
        decoder._request(json.dumps(row))
    request, _, _ = decoder._request(json.dumps(ROW))
    assert request.config.logit_bias == ((2, -100.0), (4, 1.5))
    assert request.config.min_tokens == 2 and request.config.repetition_penalty == 1.4
