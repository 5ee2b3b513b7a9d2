"""The per-beam processors against transformers (issue 52 item 2): min_tokens, logit_bias, the
frequency, presence and repetition penalties.

* Row by row, `penalties.process` and the reference `PenalisedLM` equal transformers' own
  processors (`SequenceBiasLogitsProcessor`, `RepetitionPenaltyLogitsProcessor`,
  `MinNewTokensLengthLogitsProcessor`, and OpenAI's penalties as a user processor) on
  `log_softmax` rows, as transformers' beam methods apply them.
* Beam search and speculative beam search equal transformers' `generate(num_beams=W,
  do_sample=False)` with those processors, hypothesis for hypothesis.
* transformers' `generate(do_sample=True, num_beams=2)` with those processors follows the
  enumeration of `PenalisedLM` without renormalising, which test_exactness_penalties.py shows
  dsbd's beam sampling under transformers' law follows too.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from dsbd_core import SamplingConfig
from dsbd_core.algorithm.config import config_error_message
from dsbd_core.algorithm.sequences.penalties import Processors, processors_for
from dsbd_core.algorithm.sequences.stops import ExplicitTexts, StopStrings
from tests.support.beam_search import (
    ModelLM,
    as_sets,
    assert_same_hypotheses,
    ours,
    until_eos,
)
from tests.support.exact_penalties import PenalisedLM
from tests.support.exact_reference import assert_matches
from tests.support.exact_transformers import transformers_beam_outcomes
from tests.support.tiny_models import noisy_copy, random_llama


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties as a transformers processor (it has none):
    counts over the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(fields: dict, prompt_len: int, eos: tuple[int, ...]) -> LogitsProcessorList:
    """transformers' processors for `fields`, in the order `generate` builds them."""
    bias = [[[t], b] for t, b in fields.get("logit_bias", {}).items()]
    out = LogitsProcessorList()
    if bias:
        out.append(SequenceBiasLogitsProcessor(bias))
    if fields.get("repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    if fields.get("min_tokens"):
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, fields["min_tokens"], list(eos)))
    out.append(
        OpenAIPenalties(
            prompt_len, fields.get("frequency_penalty", 0.0), fields.get("presence_penalty", 0.0)
        )
    )
    return out


FIELDS = [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7, "logit_bias": {2: 3.0, 5: -2.0}},
    {"frequency_penalty": 1.5, "presence_penalty": 0.8, "min_tokens": 4},
    {
        "min_tokens": 2,
        "frequency_penalty": -0.6,
        "presence_penalty": 1.1,
        "repetition_penalty": 1.3,
        "logit_bias": {0: -1.0, 7: 100.0, 3: -100.0},
    },
]


@pytest.mark.parametrize("fields", FIELDS)
def test_rows_are_transformers_processed_rows(fields: dict) -> None:
    """On random log_softmax rows and contexts: transformers' processors = PenalisedLM
    (normalise=False) = the engine's processing, beam (search) path; renormalised likewise."""
    from dsbd_core.algorithm.scorer import Roots
    from dsbd_core.algorithm.sequences.penalties import _root_counts, process

    vocab, eos, prompt = 9, (0, 4), [3, 5, 3, 8]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor([prompt + [1, 3, 3, 2, 7], prompt + [0, 7, 7, 7, 6]])
    for length in range(len(prompt), tokens.shape[1] + 1):
        context = tokens[:, :length]
        logp = torch.log_softmax(torch.randn(2, vocab, generator=gen, dtype=torch.float64), -1)
        expected = hf_processors(fields, len(prompt), eos)(context, logp.clone())
        config = SamplingConfig(
            eos_token_ids=eos, search=True, width=2, **{k: v for k, v in fields.items()}
        )
        procs = processors_for(config, vocab)
        assert isinstance(procs, Processors) and not procs.normalise
        roots = Roots(
            context[None], torch.tensor([length]), torch.ones(1, 2, dtype=torch.bool), None
        )
        counts = _root_counts(procs, roots, torch.tensor([len(prompt)]))
        got = process(procs, logp[None], counts, None)[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        for j, (row, seq) in enumerate(zip(expected, context.tolist(), strict=True)):
            lm = _RowLM(logp[j])
            reference = PenalisedLM(
                lm,
                len(prompt),
                eos=eos,
                min_tokens=fields.get("min_tokens", 0),
                frequency=fields.get("frequency_penalty", 0.0),
                presence=fields.get("presence_penalty", 0.0),
                repetition=fields.get("repetition_penalty", 1.0),
                bias=fields.get("logit_bias"),
                normalise=False,
            )
            np.testing.assert_allclose(reference.next_logprobs(seq), row.numpy(), atol=1e-12)
        paper = processors_for(config.model_copy(update={"search": False}), vocab)
        assert paper is not None and paper.normalise
        normalised = process(paper, logp[None], counts, None)[0]
        torch.testing.assert_close(normalised, torch.log_softmax(expected, -1))


class _RowLM:
    """One step's row as a model over whole sequences (for `PenalisedLM`)."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row, self.vocab_size = row.numpy(), row.shape[0]

    def next_logprobs(self, seq: list[int]) -> np.ndarray:
        return self.row.copy()


def hf_search_with(
    model: torch.nn.Module,
    prompt: list[int],
    width: int,
    eos: tuple[int, ...],
    max_new: int,
    fields: dict,
) -> list[tuple[list[int], float | None]]:
    """transformers' beam search with the processors of `fields`: (generated ids, score)."""
    config = GenerationConfig(
        num_beams=width,
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
        num_return_sequences=width,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            logits_processor=hf_processors(fields, len(prompt), eos),
        )
    hypotheses = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        generated = row[len(prompt) :]
        ends = [i for i, t in enumerate(generated) if t in eos]
        hypotheses.append((generated[: ends[0] + 1] if ends else generated, score))
    return hypotheses


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_beam_search_with_processors_equals_transformers(seed: int) -> None:
    target = random_llama(seed, eos_boost=1.5)
    draft = noisy_copy(target, 0.2)
    eos = (0,)
    prompts = [[3, 5, 7, 5], [11, 2], [9, 4, 4, 8, 2, 17]]
    cases = [(f, w) for f in FIELDS for w in (2, 3)]
    changed = 0
    for i, (fields, width) in enumerate(cases):
        prompt = prompts[i % len(prompts)]
        max_new = 8 + i % 3
        expected = hf_search_with(target, prompt, width, eos, max_new, fields)
        knobs: dict[str, Any] = dict(width=width, max_new_tokens=max_new, eos_token_ids=eos)
        context = {"case": (fields, width, prompt), "eos": eos}
        searched = ours("beam_search", target, prompt, None, gamma=2 + i % 2, **knobs, **fields)
        assert_same_hypotheses(searched, expected, context)
        speculative = ours(
            "spec_beam_search", target, prompt, draft, gamma=2 + i % 2, **knobs, **fields
        )
        assert_same_hypotheses(speculative, expected, context)
        plain = ours("beam_search", target, prompt, None, **knobs)
        changed += [b.token_ids for b in plain.beams] != [ids for ids, _ in expected]
    assert changed >= len(cases) // 2  # the processors changed what the search returns


@pytest.mark.slow
def test_transformers_beam_sampling_with_processors_follows_the_enumeration() -> None:
    """transformers' own sampled beam search with the processors = the enumeration of the
    unnormalised penalised law (which the engine follows: test_exactness_penalties.py)."""
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
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    prompt, width, max_new, runs = [1, 2], 2, 3, 50_000
    fields = FIELDS[3] | {"logit_bias": {2: 1.0, 4: -0.5}, "min_tokens": 1}
    samples = []
    torch.manual_seed(1)
    for _ in range(runs // 10_000):
        out = model.generate(
            torch.tensor([prompt] * 10_000),
            attention_mask=torch.ones(10_000, len(prompt)),
            do_sample=True,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_new,
            top_k=0,
            eos_token_id=0,
            pad_token_id=0,
            logits_processor=hf_processors(fields, len(prompt), (0,)),
        )
        for i in range(10_000):
            rows = out[i * width : (i + 1) * width, len(prompt) :].tolist()
            samples.append(tuple(sorted(until_eos(row, 0) for row in rows)))
    lm = PenalisedLM(
        ModelLM(model),
        len(prompt),
        eos=(0,),
        min_tokens=fields["min_tokens"],
        frequency=fields["frequency_penalty"],
        presence=fields["presence_penalty"],
        repetition=fields["repetition_penalty"],
        bias=fields["logit_bias"],
        normalise=False,
    )
    exact = transformers_beam_outcomes(lm, prompt, width, max_new, {0})
    assert_matches(samples, as_sets(exact), "transformers' generate with processors")


def test_bad_fields_are_named_with_what_is_allowed() -> None:
    for field, value, allowed in (
        ("frequency_penalty", 2.5, "less than or equal to 2"),
        ("presence_penalty", -3.0, "greater than or equal to -2"),
        ("repetition_penalty", 0.0, "greater than 0"),
        ("min_tokens", -1, "greater than or equal to 0"),
        ("logit_bias", {"5": 101.0}, "-100 <= bias <= 100"),
        ("logit_bias", {str(i): 1.0 for i in range(301)}, "at most 300"),
    ):
        with pytest.raises(ValueError) as caught:
            SamplingConfig(**{field: value})
        message = config_error_message(caught.value)  # type: ignore[arg-type]
        assert field in message and allowed in message, message
    with pytest.raises(ValueError, match="min_tokens=9 is larger than max_new_tokens=8"):
        SamplingConfig(min_tokens=9, max_new_tokens=8)
    with pytest.raises(
        ValueError, match=r"logit_bias: token id 12 is outside the vocabulary; allowed: 0\.\.9"
    ):
        processors_for(SamplingConfig(logit_bias={12: 1.0}), 10)
    assert processors_for(SamplingConfig(), 10) is None


def test_no_stop_string_before_min_tokens_and_none_from_before_it_later() -> None:
    """vLLM: a stop string counts from min_tokens generated tokens on, and a match that ended
    before then stays ignored."""
    texts = ExplicitTexts(("", "a", "b", "ba"))
    stop = StopStrings(("ab",), texts, min_tokens=3)
    seq = torch.tensor([[[2, 1, 2, 1, 1], [2, 1, 1, 1, 2]]])  # prompt "b"; "aba", "aab" + ...
    prompt = torch.tensor([1])
    assert stop.finished(seq, torch.tensor([3]), prompt).tolist() == [[False, False]]
    # 3 generated: "aba" holds "ab" ending at its second token (ignored then and now);
    # "aaa" none
    assert stop.finished(seq, torch.tensor([4]), prompt).tolist() == [[False, False]]
    # 4 generated: "abaa" none ending now; "aaab" ends in "ab" now
    assert stop.finished(seq, torch.tensor([5]), prompt).tolist() == [[False, True]]
    again = pickle.loads(pickle.dumps(stop))
    assert again.min_tokens == 3 and again.finished(seq, torch.tensor([5]), prompt).tolist() == [
        [False, True]
    ]
    assert StopStrings(("ab",), texts).finished(seq, torch.tensor([3]), prompt).tolist() == [
        [True, False]
    ]


PROCESSORS = {
    "min_tokens": 3,
    "repetition_penalty": 1.5,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
    "logit_bias": {2: 1.0, 4: -3.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dsbd", "beam_search", "spec_beam_search", "sps"])
def test_processing_keeps_every_tensor_on_the_state_device(method: str) -> None:
    """The processors make no tensor off the state's device (test_engine_device's check), with
    a draft head restricted to K tokens (compact rows: the counts read at its support)."""
    from dsbd_core.models.draft_variants import restrict_head
    from dsbd_core.models.static_scorer import StaticScorer
    from tests.support.meta_device import same_decodes
    from tests.support.tiny_models import tiny

    draft = tiny("llama", 2).float()
    restrict_head(draft, torch.tensor([0, 2, 3, 5, 7, 11, 13]))
    width = 1 if method == "sps" else 3
    same_decodes(method, {"width": width, "gamma": 2, **PROCESSORS}, StaticScorer, draft)
