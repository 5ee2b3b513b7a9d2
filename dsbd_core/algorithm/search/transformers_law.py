"""Beam sampling as transformers takes it: the candidate set of one step
(`generate(do_sample=True, num_beams=W)`, `GenerationMixin._beam_search` in transformers 5.x).

Each running beam's next-token log-probs go through transformers' sampling processors, per beam
row, in its order: the temperature divides them (log-probs, not logits: `TemperatureLogitsWarper`
on `log_softmax`), top-k keeps the k highest of the row (ties with the k-th kept), top-p drops
the row's least likely tokens whose cumulative mass, counted from the bottom, stays within
1 - top_p; both keep at least #EOS + 1 tokens when W > 1 (1 when W = 1). The candidates' scores
are the beams' accumulated processed log-probs plus the processed token's; K = max(2, 1 + #EOS)
x W of them are drawn without replacement from the softmax of those scores over every (beam,
token) (`torch.multinomial`, i.e. successive sampling) and sorted by score. The rest of the step
(the EOS ones among the W best finish, the W best others run on, early stopping) is the
deterministic search's (`search.search_step`).

An accumulated processed score is the raw log-likelihood divided by the temperature (the
filters only exclude candidates), so the engine keeps raw scores and divides here: the ranking,
the length-normalised finished scores and the early-stopping comparisons are the same up to
that factor. The draw is `distributions.draw_distinct` over that softmax: successive sampling
without replacement, as `torch.multinomial` does it.
"""

from __future__ import annotations

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.distributions import NEG_INF, Source, draw_distinct, joint_filter


def row_filter(logp: torch.Tensor, config: SamplingConfig, keep_at_least: int) -> torch.Tensor:
    """[..., V] bool: the tokens transformers' top-k and top-p processors keep in each row of
    processed log-probs `logp` (already divided by the temperature)."""
    kept = torch.ones_like(logp, dtype=torch.bool)
    vocab = logp.shape[-1]
    if config.top_k:
        k = min(max(config.top_k, keep_at_least), vocab)
        kth = logp.topk(k, dim=-1).values[..., -1:]
        kept = logp >= kth
    if config.top_p < 1.0:
        scores = logp.masked_fill(~kept, NEG_INF)
        ascending, order = scores.sort(dim=-1, stable=True)
        mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= 1.0 - config.top_p
        drop[..., vocab - keep_at_least :] = False
        kept = kept & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return kept


def law_scores(
    weights: torch.Tensor, logp: torch.Tensor, width: int, n_eos: int, config: SamplingConfig
) -> torch.Tensor:
    """[B, P x V] the candidates' processed accumulated scores (raw / temperature, -inf where
    a processor removed the token or the parent is not a running beam): their softmax is the
    law the K candidates are drawn from."""
    processed = logp.to(torch.float64) / config.temperature
    kept = row_filter(processed, config, n_eos + 1 if width > 1 else 1)
    scores = (weights / config.temperature).masked_fill(~kept, NEG_INF)
    return scores.reshape(weights.shape[0], -1)


def ranked(
    weights: torch.Tensor, index: torch.Tensor, exists: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drawn candidates `index` [B, K] sorted by score as transformers sorts its draws: (raw
    scores best first, -inf where none was drawn; their indices).

    Equal scores (exact ties: an n-gram table's same transitions in another order) are ordered
    by candidate index, not by draw order: which of two tied candidates runs on or finishes
    then depends on no random number, so the law is the one an enumeration states
    (tests/support/exact_transformers.py); transformers leaves that order to `torch.sort`."""
    flat = weights.reshape(weights.shape[0], -1)
    index, by_index = index.sort(dim=1)
    exists = exists.gather(1, by_index)
    values = torch.where(exists, flat.gather(1, index), NEG_INF)
    values, order = values.sort(dim=1, descending=True, stable=True)
    return values, index.gather(1, order)


def sampled_candidates(
    weights: torch.Tensor,
    logp: torch.Tensor,
    keep: int,
    width: int,
    n_eos: int,
    config: SamplingConfig,
    source: Source,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K = `keep` candidates: (scores [B, K] raw log-likelihoods, best first, -inf
    where fewer than K could be drawn; flat indices parent * V + token [B, K]).

    weights: [B, P, V] float64 raw accumulated log-likelihoods, -inf at invalid parents;
    logp: [B, P, V] the target's log-probs at the parents.
    """
    scores = law_scores(weights, logp, width, n_eos, config)
    law = joint_filter(scores, 1.0, 0, 1.0)  # a softmax that keeps empty rows at 0
    drawn, _, exists = draw_distinct(law, keep, source)
    return ranked(weights, drawn, exists)
