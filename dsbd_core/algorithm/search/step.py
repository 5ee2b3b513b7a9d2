"""One step of deterministic beam search, as transformers takes it (`generate(num_beams=W,
do_sample=False)`, `GenerationMixin._beam_search` in transformers 5.x), batched over sessions.

Every step scores each candidate (running beam, next token) by score(beam) + log p(token | beam)
(raw target log-probs: no temperature, no filter) and keeps the K = max(2, 1 + #EOS) * W best:

* a candidate among the W best that ends in an EOS token, or that reaches max_new_tokens, is a
  finished hypothesis with the normalised score log-likelihood / generated_length **
  length_penalty; the session keeps the W best finished hypotheses (`finished_scores`);
* the W best candidates that did not stop are the next running beams, best first (K >= 2W
  guarantees W of them, since each beam has at most #EOS stopping candidates);
* the session's search ends when no running beam can still beat the worst of W finished ones
  (`early_stopping`: False compares at the running beams' current length, "never" at
  max_new_tokens when length_penalty > 0; True ends as soon as W have finished), or when every
  candidate stopped (max_new_tokens reached).

W = 1 is greedy decoding, which is what transformers runs for `num_beams=1` (not its beam
search): the search ends as soon as the best candidate stops.

The speculative search (`walk.py`) takes exactly these steps; only where the target's
log-probs at the running beams come from changes (the forest's nodes instead of a new forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.distributions import NEG_INF, Source
from dsbd_core.algorithm.search.transformers_law import sampled_candidates


@dataclass
class SearchStep:
    """What one step decided for every session: next running beams and finished hypotheses.

    Candidate indices are flat over the step's parent rows: parent * V + token.
    """

    running: torch.Tensor  # [B, W] the next running beams, best first
    running_score: torch.Tensor  # [B, W] their log-likelihoods (float64)
    running_exists: torch.Tensor  # [B, W]
    pooled: torch.Tensor  # [B, K] candidates that enter the W best finished hypotheses
    pooled_eos: torch.Tensor  # [B, K] ... by an EOS token (else: by reaching max_new_tokens)
    candidates: torch.Tensor  # [B, K] the K best candidates (flat index)
    candidate_score: torch.Tensor  # [B, K] their log-likelihoods
    finished_scores: torch.Tensor  # [B, W] the W best normalised finished scores, best first
    done: torch.Tensor  # [B] the search ended with this step


def search_step(
    parent_score: torch.Tensor,
    logp: torch.Tensor,
    valid: torch.Tensor,
    generated: torch.Tensor,
    finished_scores: torch.Tensor,
    eos: torch.Tensor,
    config: SamplingConfig,
    source: Source | None = None,
    drawn: tuple[torch.Tensor, torch.Tensor] | None = None,
    stopped: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SearchStep:
    """One beam-search step from the running beams marked `valid` [B, P] among `P` parent rows.

    parent_score: [B, P] log-likelihoods; logp: [B, P, V] the target's log-probs at the parents;
    generated: [B] generated length of the candidates (tokens after the prompt, this one
    included); finished_scores: [B, W] the session's W best normalised finished scores so far.
    `source`: the K candidates are sampled as transformers' beam sampling samples them
    (`transformers_law.py`), drawing from it; `drawn`: they were drawn already (scores best
    first, indices: a verified layer, `sampled.py`); neither: the K best
    (deterministic search). `stopped`: which candidates (flat indices [B, K]) finish by a stop
    string (`stops.py`); they stop as EOS candidates do, and a deterministic step takes as
    many more of the best candidates as it needs to keep W running (the W best that do not
    stop, as the EOS bound K = max(2, 1 + #EOS) x W guarantees without stop strings).
    """
    batch, parents, vocab = logp.shape
    width = finished_scores.shape[1]
    weights = parent_score[:, :, None] + logp.to(torch.float64)
    weights = weights.masked_fill_(~valid[:, :, None], NEG_INF)
    keep = min(max(2, 1 + eos.numel()) * width, parents * vocab)
    if drawn is not None:
        values, indices = drawn
    elif source is None:
        values, indices = weights.reshape(batch, -1).topk(keep, dim=1)  # sorted: best first
        if stopped is not None:
            values, indices = _enough_running(weights, values, indices, eos, stopped, width)
    else:
        values, indices = sampled_candidates(
            weights, logp, keep, width, eos.numel(), config, source
        )
    exists = torch.isfinite(values)
    is_eos = torch.isin(indices % vocab, eos)
    if stopped is not None:  # a stop string ends a hypothesis as an EOS token does
        is_eos = is_eos | stopped(indices)
    at_limit = (generated >= config.max_new_tokens)[:, None]
    stopping = exists & (is_eos | at_limit)
    # Only the W best candidates may finish (the rest are the running beams' backup).
    lengths = generated.to(torch.float64)[:, None] ** config.length_penalty
    normalised = torch.where(stopping, values / lengths, NEG_INF)
    normalised[:, width:] = NEG_INF
    full = torch.isfinite(finished_scores).all(dim=1)
    if config.early_stopping is True:  # W finished: nothing more enters
        normalised = torch.where(full[:, None], NEG_INF, normalised)
    merged = torch.cat([finished_scores, normalised], dim=1).topk(width, dim=1).values
    pooled = torch.isfinite(normalised) & (normalised >= merged[:, -1:])
    running_key = torch.where(stopping | ~exists, NEG_INF, values)
    chosen = running_key.topk(min(width, keep), dim=1)
    running = indices.gather(1, chosen.indices)
    running_exists = torch.isfinite(chosen.values)
    running_score = torch.where(running_exists, chosen.values, 0.0)
    if running.shape[1] < width:  # fewer candidates than beams (tiny vocabularies)
        pad = width - running.shape[1]
        running = torch.cat([running, running.new_zeros(batch, pad)], dim=1)
        running_score = torch.cat([running_score, running_score.new_zeros(batch, pad)], dim=1)
        running_exists = torch.cat([running_exists, running_exists.new_zeros(batch, pad)], dim=1)
    done = _search_done(running_score, running_exists, merged, generated, config)
    if width == 1:  # greedy: transformers' generate(num_beams=1) stops at the best candidate
        done = done | stopping[:, 0]
    return SearchStep(
        running=running,
        running_score=running_score,
        running_exists=running_exists,
        pooled=pooled,
        pooled_eos=pooled & is_eos,
        candidates=indices,
        candidate_score=values,
        finished_scores=merged,
        done=done | (stopping | ~exists).all(dim=1),
    )


def _enough_running(
    weights: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    eos: torch.Tensor,
    stopped: Callable[[torch.Tensor], torch.Tensor],
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best candidates, doubled in number until W of them (or all there are) do not
    stop in every session: their values and indices, best first."""
    flat = weights.reshape(weights.shape[0], -1)
    vocab = weights.shape[2]
    while True:
        ends = torch.isin(indices % vocab, eos) | stopped(indices)
        running = (torch.isfinite(values) & ~ends).sum(dim=1)
        if bool((running >= width).all()) or indices.shape[1] >= flat.shape[1]:
            return values, indices
        values, indices = flat.topk(min(2 * indices.shape[1], flat.shape[1]), dim=1)


def _search_done(
    running_score: torch.Tensor,
    running_exists: torch.Tensor,
    finished_scores: torch.Tensor,
    generated: torch.Tensor,
    config: SamplingConfig,
) -> torch.Tensor:
    """transformers' stopping rule after a step (`_check_early_stop_heuristic`): [B] done."""
    full = torch.isfinite(finished_scores).all(dim=1)
    penalty = config.length_penalty
    if config.early_stopping == "never" and penalty > 0.0:
        best_length = torch.full_like(generated, config.max_new_tokens)
    else:
        best_length = generated
    best = running_score.masked_fill(~running_exists, NEG_INF).amax(dim=1)
    best_possible = best / best_length.to(torch.float64) ** penalty
    can_improve = ~full | (best_possible > finished_scores[:, -1])
    done = ~can_improve | ~running_exists.any(dim=1)
    if config.early_stopping is True:
        done = done | full
    return done
