"""Stop strings (issue 52): the check the engine runs, the tokenizer's byte table it reads, and
decodes of every sampling method on a table model whose tokens spell the stops.

The laws are checked at 1e5 sessions in test_exactness_stops.py; here, fast, the rule itself:
a beam finishes exactly where its text first holds a stop, whichever side (draft node, accepted
node, fill, bonus) produced the token, across iterations and draft layers.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer, generate_batch
from dsbd_core.algorithm.sequences.stop_text import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    first_stop,
    held_back,
    stop_problem,
)
from dsbd_core.algorithm.sequences.stops import ExplicitTexts, StopStrings
from dsbd_core.models import load_tokenizer
from dsbd_core.models.token_bytes import TokenizerTexts, token_bytes
from tests.support.exact_reference import random_table

TEXTS = ("", "a", "b", "ba", "é", "c")
STOPS = ("aba", "bb", "cc")


def _stop() -> StopStrings:
    return StopStrings(STOPS, ExplicitTexts(TEXTS))


def _text(tokens: list[int]) -> str:
    return "".join(TEXTS[t] for t in tokens)


def test_finished_reads_the_generated_text_only_and_across_tokens() -> None:
    stop = _stop()
    # prompt [3] = "ba"; generated "ba" + "ba" -> "baba" holds "aba" across a token's inside
    seq = torch.tensor([[[3, 3, 3, 0], [3, 1, 2, 0], [3, 1, 1, 0]]])
    got = stop.finished(seq, torch.tensor([3]), torch.tensor([1]))
    assert got.tolist() == [[True, False, False]]
    # "a" "b" "a": three tokens, found at the third; the prompt's "ba" never counts
    seq = torch.tensor([[[3, 1, 2, 1], [3, 2, 2, 0]]])
    assert stop.finished(seq, torch.tensor([4]), torch.tensor([1])).tolist() == [[True, True]]
    assert stop.finished(seq, torch.tensor([1]), torch.tensor([1])).tolist() == [[False, False]]


def test_a_stop_check_pickles_as_its_strings_and_names_its_tokenizer() -> None:
    stop = StopStrings(("\n\n", "Question:"), TokenizerTexts("smollm2"))
    assert len(pickle.dumps(stop)) < 400  # no byte table, no memo: it rides every call
    stop.finished(torch.tensor([[[5, 6]]]), torch.tensor([2]), torch.tensor([1]))
    again = pickle.loads(pickle.dumps(stop))
    assert again.stops == stop.stops and again.window == len(b"Question:")


def test_smollm2_byte_table_joins_to_its_decoded_text() -> None:
    tokenizer, _ = load_tokenizer("smollm2")
    table = token_bytes(tokenizer)
    rng = random.Random(0)
    texts = ["Hello world.\n\nQuestion: 2+2?\ndef f():\n    return 'café 日本 🙂'"]
    samples = [tokenizer.encode(t) for t in texts]
    samples += [[rng.randrange(len(tokenizer)) for _ in range(20)] for _ in range(50)]
    for ids in samples:
        joined = b"".join(table[t] for t in ids).decode("utf-8", "replace")
        assert joined == tokenizer.decode(ids, skip_special_tokens=True)


def test_bad_stop_lists_are_named_with_what_is_allowed() -> None:
    assert stop_problem(["x"] * (MAX_STOPS + 1)) == f"17 stop strings; allowed: at most {MAX_STOPS}"
    assert "stop[1]='' is empty" in (stop_problem(["a", ""]) or "")
    assert f"at most {MAX_STOP_CHARS}" in (stop_problem(["y" * (MAX_STOP_CHARS + 1)]) or "")
    assert stop_problem(["\n\n", "Question:"]) is None
    with pytest.raises(ValueError, match="stop"):
        StopStrings((), ExplicitTexts(TEXTS))


def test_where_text_is_cut_and_what_a_stream_holds_back() -> None:
    assert first_stop("x Question: y", ["Question:", "\n"]) == (2, "Question:")
    assert first_stop("abcd", ["bc", "abcd"]) == (0, "abcd")  # the earliest start
    assert first_stop("none", ["stop"]) is None
    assert held_back("answer Ques", ["Question:"]) == 4
    assert held_back("answer\n", ["\n\n", "Question:"]) == 1
    assert held_back("answer.", ["\n\n"]) == 0


def _table(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return random_table(rng, len(TEXTS), 2, concentration=1.5)


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("sample", {}),
        ("sps", {"gamma": 3}),
        ("beam", {"width": 3}),
        ("beam", {"width": 3, "mode": "with_replacement"}),
        ("dsbd", {"width": 3, "gamma": 3, "threshold": None}),
        ("dsbd", {"width": 3, "gamma": 2, "threshold": 0.6}),
        ("dsbd", {"width": 2, "gamma": 3, "lean_memory": True}),
        ("beam", {"width": 3, "selection": "transformers"}),
        ("dsbd", {"width": 2, "gamma": 2, "selection": "transformers"}),
        ("beam_search", {"width": 3}),
        ("spec_beam_search", {"width": 3, "gamma": 3}),
    ],
)
@pytest.mark.slow  # over a second: outside the quick loop
def test_every_beam_finishes_exactly_at_its_first_stop(method: str, extra: dict) -> None:
    """Whichever method, each returned beam's text holds a stop only at its very end, a beam
    that holds one is finished, and stops were met (spelled by several tokens, mid-decode)."""
    target, draft = _table(1), _table(2)
    cfg = SamplingConfig(max_new_tokens=8, eos_token_ids=(0,), seed=3, **extra)
    results = generate_batch(
        method,
        TableScorer(torch.from_numpy(target)),
        [[t] for t in range(1, len(TEXTS))] * 60,
        cfg,
        TableScorer(torch.from_numpy(draft)),
        stop=_stop(),
    )
    stopped = 0
    for result in results:
        for beam in result.beams:
            ids = beam.token_ids
            holds = [any(s in _text(ids[:i]) for s in STOPS) for i in range(1, len(ids) + 1)]
            assert not any(holds[:-1]), (method, ids)
            if holds and holds[-1]:
                assert beam.finished
                stopped += 1
            elif beam.finished:
                assert ids[-1] == 0  # else only an EOS finishes a beam
    assert stopped > 50


@pytest.mark.parametrize(("width", "gamma", "draft_width"), [(1, 3, None), (3, 2, None), (2, 3, 4)])
def test_speculative_search_with_stops_gives_beam_search_tokens(
    width: int, gamma: int, draft_width: int | None
) -> None:
    """Stops met inside the drafted forest (several layers deep) end the target's hypotheses
    where plain beam search ends them: the same tokens and scores."""
    target, draft = _table(4), _table(5)
    cfg = SamplingConfig(
        max_new_tokens=9, eos_token_ids=(0,), width=width, gamma=gamma, draft_width=draft_width
    )
    prompts = [[t] for t in range(1, len(TEXTS))] * 8
    scorer = TableScorer(torch.from_numpy(target))
    plain = generate_batch("beam_search", scorer, prompts, cfg, stop=_stop())
    drafted = generate_batch(
        "spec_beam_search", scorer, prompts, cfg, TableScorer(torch.from_numpy(draft)), stop=_stop()
    )
    for a, b in zip(plain, drafted, strict=True):
        assert [x.token_ids for x in a.beams] == [x.token_ids for x in b.beams]
        assert [x.score for x in a.beams] == pytest.approx([x.score for x in b.beams], abs=1e-12)
    stopped = [b for r in plain for b in r.beams if b.finished and b.token_ids[-1] != 0]
    assert len(stopped) > 10
