"""A layer's candidate table: every (parent beam, next token) pair, with its log-weight and score.

Beam sampling, the draft's proposals and DSBD's target layer distributions all start from the
same table: log-weight = score(parent) + log p(token | parent), flattened row-major
(`parent * V + token`, ALGORITHM.md §0.2), filtered and normalised by `distributions.joint_filter`.
The tables are vocabulary-wide; the scores that become beams' log-likelihoods are few and are
looked up on demand, always in float64 (`Scores`).
"""

from __future__ import annotations

import torch

from dsbd_core.algorithm.draws.distributions import NEG_INF


def layer_candidates(
    parent_score: torch.Tensor, logp: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The candidate table of a layer: log-weights score(parent) + log p(token | parent), [B, N].

    In float64 (exactness tests) this is the plain sum. For float32 tables the parents' scores
    (float64 log-likelihoods, large in magnitude after many tokens) are first shifted by their
    row maximum: every filter and the softmax are shift-invariant, and the shifted values keep
    full float32 precision.
    """
    if logp.dtype == torch.float64:
        weights = parent_score[:, :, None] + logp
    else:
        top = parent_score.masked_fill(~valid, NEG_INF).amax(dim=1, keepdim=True)
        shift = torch.where(torch.isfinite(top), top, 0.0)
        weights = (parent_score - shift).to(logp.dtype)[:, :, None] + logp
    return weights.masked_fill_(~valid[:, :, None], NEG_INF).reshape(valid.shape[0], -1)


class Scores:
    """The true log-likelihood (float64) of any candidate of a layer, looked up on demand."""

    def __init__(self, parent_score: torch.Tensor, logp: torch.Tensor) -> None:
        self.parent_score, self.logp = parent_score, logp.reshape(logp.shape[0], -1)
        self.vocab = logp.shape[-1]

    def of(self, index: torch.Tensor) -> torch.Tensor:
        """Scores of the flat candidate indices `index` [B, n] (parent * V + token)."""
        parent = self.parent_score.gather(1, index // self.vocab)
        return parent + self.logp.gather(1, index).to(torch.float64)
