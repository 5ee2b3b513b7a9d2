"""Deterministic beam search, plain and speculative, against transformers (issue 20).

`beam_search` must return what `transformers`' `generate(num_beams=W, do_sample=False)`
returns, token for token and hypothesis for hypothesis (all W, best first, with their
length-normalised scores), including length_penalty, early_stopping and EOS handling; and
`spec_beam_search` the same tokens whatever its draft, with fewer target forwards when the draft
agrees with the target. transformers scores in float32, we in float64: scores agree to 1e-4.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from dsbd_core import SamplingConfig, generate
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models import load_causal_lm, load_tokenizer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.beam_search import assert_same_hypotheses, ours
from tests.support.tiny_models import build_pair, noisy_copy, random_llama


def hf_search(
    model: torch.nn.Module,
    prompt: list[int],
    width: int,
    eos: tuple[int, ...],
    max_new: int,
    length_penalty: float,
    early_stopping: Any,
) -> list[tuple[list[int], float | None]]:
    """transformers' beam search: all W hypotheses, best first, as (generated ids, score);
    W = 1 is its greedy decoding, which reports no score (None)."""
    config = GenerationConfig(
        num_beams=width,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new_tokens=max_new,
        min_new_tokens=0,
        eos_token_id=list(eos),
        pad_token_id=eos[0],
        num_return_sequences=width,
        return_dict_in_generate=True,
        output_scores=True,
        repetition_penalty=1.0,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    hypotheses = []
    scores = out.sequences_scores.tolist() if width > 1 else [None]
    for row, score in zip(out.sequences.tolist(), scores, strict=True):
        generated = row[len(prompt) :]
        ends = [i for i, t in enumerate(generated) if t in eos]
        hypotheses.append((generated[: ends[0] + 1] if ends else generated, score))
    return hypotheses


# (W, length_penalty, early_stopping, max_new_tokens)
GRID = [
    (w, lp, es, m)
    for (w, lp, es), m in zip(
        product((1, 2, 3, 4), (1.0, 0.0, 2.0), (False, True, "never")),
        [6, 11, 16] * 12,
        strict=False,
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_beam_search_equals_transformers_on_random_llamas(seed: int) -> None:
    """36 settings of W, length penalty, early stopping and length per model; one EOS id (two
    on seed 3); plain search, and speculative with a noisy draft, token for token."""
    target = random_llama(seed, eos_boost=1.5)
    draft = noisy_copy(target, 0.2)
    eos = (0,) if seed != 3 else (0, 5)
    prompts = [[3, 5, 7], [11, 2], [9, 4, 4, 8, 2, 17]]
    finished = 0
    for i, (width, penalty, early, max_new) in enumerate(GRID):
        prompt = prompts[i % len(prompts)]
        expected = hf_search(target, prompt, width, eos, max_new, penalty, early)
        knobs = dict(
            width=width,
            length_penalty=penalty,
            early_stopping=early,
            max_new_tokens=max_new,
            eos_token_ids=eos,
            gamma=2 + i % 3,
        )
        context = {"case": (width, penalty, early, max_new, prompt), "eos": eos}
        plain = ours("beam_search", target, prompt, None, **knobs)
        assert_same_hypotheses(plain, expected, context)
        speculative = ours("spec_beam_search", target, prompt, draft, **knobs)
        assert_same_hypotheses(speculative, expected, context)
        finished += sum(b.finished for b in plain.beams)
    assert finished >= 20  # EOS handling was exercised, not only the length limit


@pytest.mark.slow
def test_beam_search_equals_transformers_on_the_embedded_style_target(tmp_path: Path) -> None:
    """The tiny tokenizer + Llama pair the serving tests use (saved, loaded in float64)."""
    target_dir, draft_dir = build_pair(tmp_path)
    target = load_causal_lm(str(target_dir), dtype=torch.float64).model
    draft = load_causal_lm(str(draft_dir), dtype=torch.float64).model
    tokenizer, stop_ids = load_tokenizer(str(target_dir))
    prompts = [tokenizer.encode(text) for text in ("one two three", "The quick brown", "def")]
    for i, (width, penalty, early, max_new) in enumerate(GRID[::3]):
        prompt = prompts[i % len(prompts)]
        expected = hf_search(target, prompt, width, stop_ids, max_new, penalty, early)
        knobs = dict(
            width=width,
            length_penalty=penalty,
            early_stopping=early,
            max_new_tokens=max_new,
            eos_token_ids=stop_ids,
            gamma=3,
        )
        context = {"case": (width, penalty, early, max_new, prompt), "eos": stop_ids}
        assert_same_hypotheses(
            ours("beam_search", target, prompt, None, **knobs), expected, context
        )
        assert_same_hypotheses(
            ours("spec_beam_search", target, prompt, draft, **knobs), expected, context
        )


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_spec_beam_search_with_the_ngram_draft_gives_beam_searchs_tokens(seed: int) -> None:
    """The prompt-lookup draft (issue 48): transformers' hypotheses, token for token, whether
    the context matches (repeating prompts; the search's own loops) or not (a first token)."""
    target = random_llama(seed, eos_boost=1.0)
    prompts = [[3, 5, 7, 3, 5, 7, 3], [9, 4, 4, 8, 9, 4, 4], [11]]
    accepted = 0
    for i, (width, penalty, early, max_new) in enumerate(GRID[::2]):
        prompt = prompts[i % len(prompts)]
        expected = hf_search(target, prompt, width, (0,), max_new, penalty, early)
        config = SamplingConfig(
            width=width,
            length_penalty=penalty,
            early_stopping=early,
            max_new_tokens=max_new,
            eos_token_ids=(0,),
            gamma=2 + i % 3,
        )
        draft = NgramDraft(target.config.vocab_size, 1 + i % 4)
        got = generate("spec_beam_search", TransformerScorer(target), prompt, config, draft)
        context = {"case": (width, penalty, early, max_new, prompt), "eos": (0,)}
        assert_same_hypotheses(got, expected, context)
        accepted += got.stats.accepted_tokens
    assert accepted > 0  # the look-up's forests were verified, and some of them passed


@pytest.mark.parametrize("width", [1, 3])
def test_a_draft_equal_to_the_target_saves_target_forwards(width: int) -> None:
    target = random_llama(4)
    knobs = dict(width=width, max_new_tokens=24, gamma=4)  # no EOS: all 24 steps
    plain = ours("beam_search", target, [3, 5, 7], None, **knobs)
    same = ours("spec_beam_search", target, [3, 5, 7], target, **knobs)
    assert [b.token_ids for b in same.beams] == [b.token_ids for b in plain.beams]
    assert same.stats.target_forward_passes < plain.stats.target_forward_passes / 2
    assert same.stats.acceptance_rate > 0.9
    assert plain.stats.target_forward_passes == plain.stats.tokens_emitted  # one per step


def test_search_runs_in_the_lockstep_batch_decoder_as_in_generate() -> None:
    """The one decode loop under its batch driver: requests of different methods together."""
    target = random_llama(1, eos_boost=1.5)
    draft = noisy_copy(target, 0.2)
    requests = [
        Request(
            [3, 5, 7], SamplingConfig(width=3, max_new_tokens=10, eos_token_ids=(0,)), "beam_search"
        ),
        Request(
            [11, 2],
            SamplingConfig(
                width=2, gamma=3, max_new_tokens=12, eos_token_ids=(0,), length_penalty=0.5
            ),
            "spec_beam_search",
        ),
        Request([9, 4], SamplingConfig(width=2, max_new_tokens=8, seed=1), "dsbd"),
        Request(
            [9, 4, 4], SamplingConfig(width=1, gamma=2, search=True, max_new_tokens=9), "sps"
        ),  # speculative greedy
    ]
    results, _ = decode_lockstep(
        requests,
        SessionBatcher(TransformerScorer(target)),
        SessionBatcher(TransformerScorer(draft)),
    )
    for request, got in zip(requests, results, strict=True):
        assert got.error is None and got.result is not None, got.error
        want = ours(
            request.method,
            target,
            request.prompt_ids,
            draft if request.method != "beam_search" else None,
            **request.config.model_dump(),
        )
        assert [b.token_ids for b in got.result.beams] == [b.token_ids for b in want.beams]
        assert got.result.stats.as_dict() == want.stats.as_dict()


def test_greedy_is_search_of_width_one() -> None:
    """`sample` with `search` is greedy decoding: transformers' num_beams=1, do_sample=False."""
    target = random_llama(2, eos_boost=1.0)
    result = ours(
        "sample", target, [3, 5], None, search=True, max_new_tokens=10, eos_token_ids=(0,)
    )
    expected = hf_search(target, [3, 5], 1, (0,), 10, 1.0, False)
    assert result.best.token_ids == expected[0][0]
    ids = torch.tensor([[3, 5]])
    with torch.no_grad():
        greedy = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=1,
            max_new_tokens=10,
            eos_token_id=[0],
            pad_token_id=0,
        )
    generated = greedy[0, 2:].tolist()
    assert result.best.token_ids == generated[: generated.index(0) + 1 if 0 in generated else 10]
