"""DSBD under transformers' law: transformers' beam sampling, with the draft's candidates verified
so that each step's K candidates are exactly the sample transformers would draw.

transformers' step (`transformers_law.py`) draws K = max(2, 1 + #EOS) x W candidates without
replacement from P, the softmax of the processed accumulated scores over (running beam,
token), and then decides deterministically (sort by score, finish the stopping ones among the
W best, keep the W best others running). So a speculative step only has to produce that
K-sample exactly, and DSBD's distinct-beam verification does: the draft proposes a layer of
distinct candidates drawn without replacement from its own table Q (the same law on its own
log-probs), the verifier runs the distinct chain against P with width K, and fills what the
chain did not accept with its fallback and fresh draws without replacement (`verify.py`): the
K slots are an ordered without-replacement sample of P, whatever Q is. The deterministic part
then runs on it (`search.search_step`).

Across layers it is the speculative beam search's walk (`walk.py`): the draft extends its
W best non-stopping candidates of each layer; the target steps on while every running beam it
keeps is a drafted node (the forest's forward scored it), and otherwise stops the iteration
there. Sessions past their drafted depth draw their K candidates from P directly (the bonus
step). What the knobs do: gamma is how many layers the draft proposes; the draft width W_S
(default K) is how many candidates per layer it proposes: fewer than K leaves the rest to
fresh draws, so a layer's running beams are all drafted nodes less often. A layer passes when
the target's W running beams all come from accepted drafts that the draft chose to extend:
with a good draft, most of the time; its K-sample is exact either way. The width is fixed
(W, K): transformers' law has no dynamic width, so `threshold` does not apply.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.candidates import Scores
from dsbd_core.algorithm.draws.distributions import NEG_INF, draw_distinct, joint_filter
from dsbd_core.algorithm.draws.streams import ACCEPT, BONUS, DRAFT, FILL, Streams
from dsbd_core.algorithm.iteration.verify import fill_failed_layer, verify_layer
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.search.transformers_law import law_scores, ranked
from dsbd_core.algorithm.sequences.state import (
    NO_FOREST,
    DecodeState,
    Forest,
    deepest_layer,
    roots_of,
)


def candidates_per_step(config: SamplingConfig, n_eos: int) -> int:
    """K: the candidates transformers draws per step."""
    return max(2, 1 + n_eos) * config.width


def law_table(
    parent_score: torch.Tensor,
    logp: torch.Tensor,
    valid: torch.Tensor,
    config: SamplingConfig,
    n_eos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, P, V]: raw accumulated log-likelihoods, -inf at invalid parents;
    P [B, P x V]: the law the step's candidates are drawn from)."""
    weights = parent_score[:, :, None] + logp.to(torch.float64)
    weights = weights.masked_fill_(~valid[:, :, None], NEG_INF)
    scores = law_scores(weights, logp, config.width, n_eos, config)
    return weights, joint_filter(scores, 1.0, 0, 1.0)  # a softmax that keeps empty rows at 0


def draft_sampled_search(
    state: DecodeState, config: SamplingConfig, eos: torch.Tensor, streams: Streams
) -> Generator[ScoreCall, ForestLogprobs, Forest]:
    """The draft's layers: W_S (default K) candidates per layer drawn without replacement from
    its own transformers'-law table, its W best non-stopping ones extended."""
    assert state.depth is not None, "plan the iteration first (Engine.next_iteration)"
    depth, depth_max = state.depth, deepest_layer(state)
    if depth_max == 0:
        return NO_FOREST
    scored = yield ScoreCall(roots_of(state), [])
    logq, support = scored.roots, scored.support
    assert logq is not None
    width = logq.shape[-1]  # V, or K for a restricted head
    n_eos = eos.numel()
    drafts = config.draft_width or candidates_per_step(config, n_eos)
    parent_ok, sigma = state.alive, state.score
    generated = state.length - state.prompt_len
    layers, tables, probs = [], [], []
    level = 0
    while level < depth_max:  # no `for` iterator across a yield: Dynamo 2.11 loses it
        level += 1
        ok = parent_ok & (depth >= level)[:, None]
        _, table = law_table(sigma, logq, ok, config, n_eos)
        index, prob, exists = draw_distinct(table, drafts, streams.at(level, DRAFT))
        token = index % width if support is None else support[index % width]
        layer = ForestLayer(parent=index // width, token=token, exists=exists)
        layers.append(layer)
        tables.append(table)
        probs.append(prob)
        sigma = torch.where(exists, Scores(sigma, logq).of(index), 0.0)
        stops = torch.isin(token, eos) | (generated + level >= config.max_new_tokens)[:, None]
        key = torch.where(exists & ~stops, sigma, NEG_INF)
        best = key.topk(min(config.width, key.shape[1]), dim=1)
        parent_ok = torch.zeros_like(exists).scatter(1, best.indices, torch.isfinite(best.values))
        if level < depth_max:
            logq = (yield ScoreCall(None, [layer])).layers[0]
    return Forest(layers=layers, tables=tables, probs=probs, support=support)


def verified_candidates(
    level: int,
    parent_score: torch.Tensor,
    logp: torch.Tensor,
    valid: torch.Tensor,
    verifying: torch.Tensor,
    forest: Forest,
    config: SamplingConfig,
    eos: torch.Tensor,
    streams: Streams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K candidates at `level` (scores best first, indices), an exact
    without-replacement sample of P: verified drafts and fills where a session `verifying`
    has drafted the layer, drawn from P directly elsewhere."""
    vocab = logp.shape[-1]
    keep = min(candidates_per_step(config, eos.numel()), valid.shape[1] * vocab)
    weights, target = law_table(parent_score, logp, valid, config, eos.numel())
    index, _, exists = draw_distinct(target, keep, streams.at(level, BONUS))
    drawn = ranked(weights, index, exists)
    if level > len(forest.layers):
        return drawn
    layer = forest.layers[level - 1]
    table = forest.full_table(level, vocab).to(target.dtype)
    drafts = layer.parent * vocab + layer.token
    parent_valid = valid.gather(1, layer.parent) & layer.exists
    width = torch.full_like(verifying, keep, dtype=torch.long)
    verdict = verify_layer(
        target,
        table,
        valid.repeat_interleave(vocab, dim=1),
        drafts,
        forest.probs[level - 1],
        layer.exists,
        parent_valid,
        width,
        verifying,
        True,
        streams.at(level, ACCEPT),
    )
    index, exists = fill_failed_layer(
        verdict, drafts, target, keep, width, True, streams.at(level, FILL)
    )
    verified = ranked(weights, index, exists)
    rows = verifying[:, None]
    return torch.where(rows, verified[0], drawn[0]), torch.where(rows, verified[1], drawn[1])
