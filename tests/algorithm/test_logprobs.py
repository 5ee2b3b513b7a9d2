"""Per-token log-probabilities tracked while decoding (SamplingConfig.logprobs, issue 20).

Every method's returned beams carry, per token, the target's raw log-probability and its top-N
alternatives; they must equal an independent forward of the target over prompt + beam tokens
(tiny float64 Llamas: the only difference is floating-point reordering), add up to the beam's
log-likelihood, and asking for them must not move a single draw.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dsbd_core import SamplingConfig, generate, generate_batch
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.algorithm.methods import METHODS_WITH_DRAFT
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import tiny_model

VOCAB = 24
EOS = (0,)
TOP = 5
PROMPTS = [[3, 5, 7], [1, 2], [9, 4, 4, 8, 2]]
CASES: list[tuple[str, dict[str, Any]]] = [
    ("sample", {}),
    ("beam", {"width": 3}),
    ("beam", {"width": 3, "top_k": 5, "temperature": 0.7}),  # raw log-probs all the same
    ("sps", {"gamma": 3}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": None}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
    ("dsbd", {"width": 3, "draft_width": 4, "gamma": 2, "threshold": 0.9}),
    ("dsbd", {"width": 3, "gamma": 3, "lean_memory": True}),
    ("dsbd", {"width": 2, "gamma": 2, "threshold": None, "mode": "with_replacement"}),
    ("beam_search", {"width": 3}),
    ("spec_beam_search", {"width": 3, "gamma": 3}),
]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A peaky float64 target (beams differ, EOS gets drawn) and a noisy copy as the draft."""
    target = tiny_model(VOCAB, seed=5, attn_implementation="sdpa").to(torch.float64)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    draft = tiny_model(VOCAB, attn_implementation="sdpa").to(torch.float64)
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter) * parameter.std())
    return target, draft


def _decode(models, method: str, prompts: list[list[int]], **knobs: Any):
    target, draft = models
    config = SamplingConfig(max_new_tokens=12, eos_token_ids=EOS, **knobs)
    uses_draft = method in METHODS_WITH_DRAFT
    return generate_batch(
        method,
        TransformerScorer(target),
        prompts,
        config,
        TransformerScorer(draft) if uses_draft else None,
    )


def _summary(result) -> list:
    return [(b.token_ids, b.log_likelihood, b.finished, b.score) for b in result.beams]


def check_against_forward(target: torch.nn.Module, prompt: list[int], result, top: int) -> int:
    """Every beam's logprobs equal one forward of the target over prompt + beam; returns the
    number of tokens checked."""
    checked = 0
    for beam in result.beams:
        assert beam.token_logprobs is not None and beam.top_logprobs is not None
        assert len(beam.token_logprobs) == len(beam.top_logprobs) == len(beam.token_ids)
        ids = torch.tensor([prompt + beam.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(target(ids).logits[0].to(torch.float64), dim=-1)
        for i, token in enumerate(beam.token_ids):
            row = logp[len(prompt) - 1 + i]
            assert beam.token_logprobs[i] == pytest.approx(row[token].item(), abs=1e-9)
            best = row.topk(min(top, VOCAB))
            assert [t for t, _ in beam.top_logprobs[i]] == best.indices.tolist()
            assert [p for _, p in beam.top_logprobs[i]] == pytest.approx(
                best.values.tolist(), abs=1e-9
            )
            checked += 1
        # the same distribution as log_likelihood, accumulated in the same order
        assert sum(beam.token_logprobs) == pytest.approx(beam.log_likelihood, abs=1e-12)
    return checked


@pytest.mark.slow
@pytest.mark.parametrize(("method", "knobs"), CASES)
def test_logprobs_equal_an_independent_forward_and_move_no_draw(models, method, knobs) -> None:
    checked = 0
    for seed in (0, 1):
        plain = _decode(models, method, PROMPTS, seed=seed, **knobs)
        tracked = _decode(models, method, PROMPTS, seed=seed, logprobs=TOP, **knobs)
        for prompt, a, b in zip(PROMPTS, plain, tracked, strict=True):
            assert _summary(a) == _summary(b)  # bit for bit: tracking changes nothing
            assert a.stats.as_dict() == b.stats.as_dict()
            assert all(beam.token_logprobs is None for beam in a.beams)
            checked += check_against_forward(models[0], prompt, b, TOP)
    assert checked > 20


def test_logprobs_zero_tracks_the_tokens_only_and_n_past_the_vocabulary_gives_all(models):
    result = _decode(models, "dsbd", PROMPTS[:1], seed=3, width=2, logprobs=0)[0]
    assert all(top == [] for beam in result.beams for top in beam.top_logprobs)
    check_against_forward(models[0], PROMPTS[0], result, 0)
    small = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=12,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
            )
        )
        .to(torch.float64)
        .eval()
    )
    config = SamplingConfig(max_new_tokens=5, seed=0, width=2, logprobs=20)
    beam = generate("beam", TransformerScorer(small), [1, 2], config).beams[0]
    assert all(len(top) == 12 for top in beam.top_logprobs)


@pytest.mark.slow
def test_lockstep_requests_carry_the_same_logprobs_as_generate(models) -> None:
    """The lockstep batch decoder (the serving replicas' batching) splices the same values."""
    target, draft = models
    requests = []
    for i, ((method, knobs), prompt) in enumerate(zip(CASES[3:], PROMPTS * 3, strict=False)):
        config = SamplingConfig(max_new_tokens=10, eos_token_ids=EOS, seed=i, logprobs=3, **knobs)
        requests.append(Request(prompt, config, method))
    target_side, draft_side = TransformerScorer(target), TransformerScorer(draft)
    results, _ = decode_lockstep(requests, SessionBatcher(target_side), SessionBatcher(draft_side))
    for request, got in zip(requests, results, strict=True):
        assert got.error is None, got.error
        uses_draft = request.method in METHODS_WITH_DRAFT
        want = generate(
            request.method,
            TransformerScorer(target),
            request.prompt_ids,
            request.config,
            TransformerScorer(draft) if uses_draft else None,
        )
        assert got.result is not None
        assert [b.token_ids for b in got.result.beams] == [b.token_ids for b in want.beams]
        for a, b in zip(got.result.beams, want.beams, strict=True):
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-12)
            assert [[t for t, _ in top] for top in a.top_logprobs] == [
                [t for t, _ in top] for top in b.top_logprobs
            ]
