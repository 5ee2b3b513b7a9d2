"""The log-probabilities of a prompt's own tokens under the target: one forward, any scorer.

Evaluation tools score given text this way (OpenAI's `echo` with `logprobs`; lm-evaluation-
harness's loglikelihood requests): token i's log-probability given tokens 0..i-1, and the most
likely tokens there. The prompt is asked of the scorer as a forest that is a chain: its first
token is the root, every later token but the last a one-node layer whose parent is the node
before. The forest's forward returns the next-token distribution at the root and at every node,
which are the prompt's positions 1..L-1: one forward through the same `ForestScorer` contract
the decodes use, so a tensor-parallel verifier and the static path score it as they verify.
The distributions are the target's raw ones (temperature 1, no filter), as OpenAI and vLLM
report prompt log-probabilities.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots, ScoreCall


@dataclass
class PromptLogprobs:
    """Per prompt position 1..L-1 (the first token has none): the token's log-probability and
    the `top` most likely tokens there, (token id, log-probability), most likely first."""

    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def prompt_logprob_steps(
    prompt_ids: list[int], top: int
) -> Generator[ScoreCall, ForestLogprobs, PromptLogprobs]:
    """A scorer job (`session_batch.Job`) scoring the prompt in one forward."""
    if len(prompt_ids) < 2:
        return PromptLogprobs([], [])
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    roots = Roots(
        ids[:1].view(1, 1, 1),
        torch.ones(1, dtype=torch.long),
        torch.ones(1, 1, dtype=torch.bool),
        None,
    )
    zero, present = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    chain = [ForestLayer(zero, ids[i].view(1, 1), present) for i in range(1, len(prompt_ids) - 1)]
    scored = yield ScoreCall(roots, chain)
    assert scored.roots is not None and scored.support is None, "a full head scores prompts"
    rows = torch.cat([scored.roots[0]] + [layer[0] for layer in scored.layers]).double().cpu()
    chosen = rows.gather(1, ids[1:, None]).squeeze(1)
    tops: list[list[tuple[int, float]]] = [[] for _ in range(rows.shape[0])]
    if top > 0:
        values, indices = rows.topk(min(top, rows.shape[1]), dim=1)
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    return PromptLogprobs(chosen.tolist(), tops)
