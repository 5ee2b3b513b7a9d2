"""A prompt's own log-probabilities from one forward through a scorer (`prompt_logprobs`), equal
to an independent forward of the model: the basis of `echo` with `logprobs` on the server."""

from __future__ import annotations

import pytest
import torch

from dsbd_core.algorithm.drivers.session_batch import Job, SessionBatcher
from dsbd_core.algorithm.scorer import drive
from dsbd_core.algorithm.sequences.prompt_logprobs import prompt_logprob_steps
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import tiny

PROMPT = [5, 9, 2, 11, 7, 7, 3, 14, 1, 6]


def _independent(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[L - 1, V] log-probabilities of positions 1..L-1 from a plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("kind", [TransformerScorer, StaticScorer])
def test_prompt_logprobs_equal_an_independent_forward(kind: type[TransformerScorer]) -> None:
    model = tiny("llama", 1)  # float64
    scored = drive(kind(model), prompt_logprob_steps(PROMPT, 3))
    want = _independent(model, PROMPT)
    chosen = want.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    assert len(scored.token_logprobs) == len(PROMPT) - 1
    torch.testing.assert_close(
        torch.tensor(scored.token_logprobs, dtype=torch.float64), chosen, rtol=0, atol=1e-10
    )
    values, indices = want.topk(3, dim=1)
    for position, top in enumerate(scored.top_logprobs):
        assert [t for t, _ in top] == indices[position].tolist()
        assert (
            max(abs(p - v) for (_, p), v in zip(top, values[position].tolist(), strict=True))
            < 1e-10
        )


def test_prompts_scored_together_share_one_forward_and_keep_no_cache() -> None:
    """As a serving replica runs it: a job of its own key among others, released after."""
    model = tiny("llama", 1).float()
    batcher = SessionBatcher(StaticScorer(model))
    jobs = [
        Job("score-a", prompt_logprob_steps(PROMPT, 0)),
        Job("score-b", prompt_logprob_steps(PROMPT[:4], 2)),
        Job("short", prompt_logprob_steps([3], 1)),
    ]
    results, report = batcher.run(jobs)
    assert report.forwards == 1
    assert [len(r.token_logprobs) for r in results] == [9, 3, 0]
    assert results[0].top_logprobs == [[] for _ in range(9)]
    longer, shorter = (torch.tensor(r.token_logprobs) for r in results[:2])
    torch.testing.assert_close(shorter, longer[:3], rtol=0, atol=1e-5)
    for key in ("score-a", "score-b", "short"):
        batcher.release(key)
    assert batcher.cached == []
