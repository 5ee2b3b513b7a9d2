"""Beam sampling under transformers' law (`selection='transformers'`) follows it exactly.

The law is enumerated independently (`tests/support/exact_transformers.py`, written from
transformers' `_beam_search`); 5e4 sessions decoded in one batched call on exact n-gram tables must
be within the null run's TV quantile at the same sample size, for the processors and stopping rules
that change the law (temperature, top-k, top-p, length penalty, early stopping). And transformers'
own `generate(do_sample=True, num_beams=W)` on a tiny Llama follows the same enumeration (run on the
model's float64 log-probs), which ties the reference to transformers itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dsbd_core import SamplingConfig, TableScorer, generate_batch
from dsbd_core.algorithm.methods import MethodConfigError, method_config
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from tests.support.beam_search import ModelLM, as_sets, outcomes_of, until_eos
from tests.support.exact_reference import TableLM, assert_matches, random_table
from tests.support.exact_transformers import transformers_beam_outcomes

RUNS = 50_000
V, EOS, PROMPT, MAX_NEW, WIDTH = 4, 0, [1], 3, 2
CASES = [
    ("plain", {}),
    # top_k >= K = 4: below it transformers cannot draw its K candidates at the first step
    ("temperature-top-k", {"temperature": 0.7, "top_k": 4, "vocab": 5}),
    ("top-p-length-penalty", {"top_p": 0.95, "length_penalty": 0.5, "vocab": 5}),
    ("early-stopping", {"early_stopping": True, "length_penalty": 2.0}),
    ("never", {"early_stopping": "never", "temperature": 1.5}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "knobs"), CASES, ids=[c[0] for c in CASES])
def test_beam_under_transformers_law_is_exact(name: str, knobs: dict) -> None:
    knobs = dict(knobs)
    rng = np.random.default_rng(sum(map(ord, name)))
    table = random_table(rng, knobs.pop("vocab", V), 2, concentration=1.0)
    config = SamplingConfig(
        width=WIDTH,
        max_new_tokens=MAX_NEW,
        eos_token_ids=(EOS,),
        seed=3,
        selection="transformers",
        **knobs,
    )
    results = generate_batch("beam", TableScorer(torch.from_numpy(table)), [PROMPT] * RUNS, config)
    exact = transformers_beam_outcomes(TableLM(table), PROMPT, WIDTH, MAX_NEW, {EOS}, **knobs)
    assert_matches(outcomes_of(results), as_sets(exact), f"transformers' law, {name}")


SPECULATIVE = [
    ("g1", {"gamma": 1}, {}),
    ("g3", {"gamma": 3}, {}),
    ("ws3-temperature", {"gamma": 2, "draft_width": 3, "temperature": 0.8}, {}),
    (
        "zero-mass-ws6",
        {"gamma": 2, "draft_width": 6, "top_k": 4},
        {"vocab": 5, "target_zeros": 0.15, "draft_zeros": 0.3},
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "knobs", "tables"), SPECULATIVE, ids=[c[0] for c in SPECULATIVE])
def test_dsbd_under_transformers_law_is_exact(name: str, knobs: dict, tables: dict) -> None:
    """The draft's layers verified with the distinct chain of width K: transformers' law at
    fewer target forwards (EOS reachable; W_S below, at and above K; zero draft and target
    mass where `tables` says)."""
    rng = np.random.default_rng(sum(map(ord, name)) + 1)
    vocab = tables.get("vocab", V)
    target = random_table(rng, vocab, 2, concentration=1.0, zero_prob=tables.get("target_zeros", 0))
    draft = random_table(rng, vocab, 2, concentration=1.0, zero_prob=tables.get("draft_zeros", 0))
    config = SamplingConfig(
        width=WIDTH,
        max_new_tokens=MAX_NEW,
        eos_token_ids=(EOS,),
        seed=5,
        selection="transformers",
        **knobs,
    )
    results = generate_batch(
        "dsbd",
        TableScorer(torch.from_numpy(target)),
        [PROMPT] * RUNS,
        config,
        TableScorer(torch.from_numpy(draft)),
    )
    filters = {k: v for k, v in knobs.items() if k in ("temperature", "top_k", "top_p")}
    exact = transformers_beam_outcomes(TableLM(target), PROMPT, WIDTH, MAX_NEW, {EOS}, **filters)
    assert_matches(outcomes_of(results), as_sets(exact), f"dsbd under transformers' law, {name}")
    passes = sum(r.stats.target_forward_passes for r in results) / RUNS
    steps = sum(r.stats.tokens_emitted for r in results) / RUNS
    assert passes < steps, f"no step was saved ({passes:.2f} passes for {steps:.2f} steps)"


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [[1], [1, 2, 1, 3, 1, 2]], ids=["no-match-first", "matches"])
@pytest.mark.parametrize("knobs", [{"gamma": 2}, {"gamma": 3, "draft_width": 3}], ids=["g2", "g3"])
def test_dsbd_with_the_ngram_draft_under_transformers_law_is_exact(
    prompt: list[int], knobs: dict
) -> None:
    """The prompt-lookup draft (issue 48): no match at the first iteration ([1], its layers
    empty), or matches at once; transformers' law either way."""
    rng = np.random.default_rng(53)
    target = random_table(rng, V, 2, concentration=1.0)
    config = SamplingConfig(
        width=WIDTH,
        max_new_tokens=MAX_NEW,
        eos_token_ids=(EOS,),
        seed=6,
        selection="transformers",
        **knobs,
    )
    results = generate_batch(
        "dsbd", TableScorer(torch.from_numpy(target)), [prompt] * RUNS, config, NgramDraft(V, 2)
    )
    exact = transformers_beam_outcomes(TableLM(target), prompt, WIDTH, MAX_NEW, {EOS})
    assert_matches(outcomes_of(results), as_sets(exact), f"dsbd ngram, transformers' law {prompt}")
    assert any(r.stats.accepted_tokens > 0 for r in results[:1000])


@pytest.mark.slow
def test_the_paper_law_is_not_transformers_law() -> None:
    """The two laws differ (the test above could not pass for either by accident)."""
    rng = np.random.default_rng(7)
    table = random_table(rng, V, 2, concentration=1.0)
    config = SamplingConfig(width=WIDTH, max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), seed=3)
    results = generate_batch("beam", TableScorer(torch.from_numpy(table)), [PROMPT] * RUNS, config)
    exact = transformers_beam_outcomes(TableLM(table), PROMPT, WIDTH, MAX_NEW, {EOS})
    with pytest.raises(AssertionError):
        assert_matches(outcomes_of(results), as_sets(exact), "the paper's law")


@pytest.mark.slow
def test_transformers_generate_follows_the_enumeration() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=5,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    prompt = [1, 2]
    samples = []
    torch.manual_seed(1)
    for _ in range(RUNS // 10_000):
        out = model.generate(
            torch.tensor([prompt] * 10_000),
            attention_mask=torch.ones(10_000, len(prompt)),
            do_sample=True,
            num_beams=WIDTH,
            num_return_sequences=WIDTH,
            max_new_tokens=MAX_NEW,
            top_k=0,
            temperature=1.0,
            eos_token_id=EOS,
            pad_token_id=EOS,
            return_dict_in_generate=True,
            output_scores=False,
        )
        for i in range(10_000):
            rows = out.sequences[i * WIDTH : (i + 1) * WIDTH, len(prompt) :].tolist()
            samples.append(tuple(sorted(until_eos(row, EOS) for row in rows)))
    exact = transformers_beam_outcomes(ModelLM(model), prompt, WIDTH, MAX_NEW, {EOS})
    assert_matches(samples, as_sets(exact), "transformers' generate(do_sample=True, num_beams=2)")


def test_what_transformers_law_refuses_is_named() -> None:
    config = SamplingConfig(selection="transformers", width=3)
    for field, value in (("threshold", 0.7), ("lean_memory", True), ("epsilon", 0.1)):
        with pytest.raises(MethodConfigError) as caught:
            method_config("dsbd", config.model_copy(update={field: value}))
        assert caught.value.field == field and field in str(caught.value)
    with pytest.raises(ValueError, match="selection='transformers'"):
        SamplingConfig(selection="transformers", search=True)
    # one beam: transformers samples plainly, the paper's law at W = 1
    assert method_config("sample", config).selection == "paper"
    assert method_config("sps", config).selection == "paper"
    assert method_config("beam", config).selection == "transformers"
