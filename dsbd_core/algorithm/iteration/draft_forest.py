"""The draft side of an iteration: beam-sample a forest of `depth` layers (ALGORITHM.md §3).

The draft runs beam sampling of width W_S from the input beams, starting from their *target*
scores and with the same temperature and joint filter as the target, so that draft == target
gives Q == P. Each layer records the full draft table Q_l and the exact draw probability of
every draft (conditional on the earlier drafts of the layer in distinct mode): verification
needs both, and uses them whatever the draft model is (a quantised draft or one with a restricted
head stays exact, since the q the verifier sees is the q the draft drew from).

A draft whose head scores only K tokens (`ForestLogprobs.support`) is sampled on its K-wide
tables: candidate (parent, j) is token support[j]. The forest then carries the compact tables
and the support, and the verifier spreads them over the vocabulary (`Forest.full_table`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.candidates import Scores, layer_candidates
from dsbd_core.algorithm.draws.distributions import (
    Source,
    draw_distinct,
    draw_with_replacement,
    joint_filter,
)
from dsbd_core.algorithm.draws.streams import DRAFT, Streams
from dsbd_core.algorithm.iteration.beams import layer_stopped
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.sequences.state import (
    NO_FOREST,
    DecodeState,
    Forest,
    deepest_layer,
    roots_of,
)
from dsbd_core.algorithm.sequences.stops import StopStrings

# A draft layer's result: the layer, its table Q_l, each draft's draw probability, the drafts'
# scores and which of them may be parents next.
Drawn = tuple[ForestLayer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def draft_forest(
    state: DecodeState,
    config: SamplingConfig,
    vocab: int,
    eos: torch.Tensor,
    streams: Streams,
    *,
    stop: StopStrings | None = None,
    layer_fn: Callable[..., Drawn] | None = None,
) -> Generator[ScoreCall, ForestLogprobs, Forest]:
    """Draft beam sampling for up to `state.depth[b]` layers: one draft-model call per layer
    (`stop`: a node whose text holds a stop string finished, so it has no children;
    `layer_fn`: `draft_layer` run another way, `side_graphs.SideGraph`)."""
    layer_fn = draft_layer if layer_fn is None else layer_fn  # no truth of a function: Dynamo
    assert state.depth is not None, "plan the iteration first (Engine.next_iteration)"
    depth, alive = state.depth, state.alive
    depth_max = deepest_layer(state)
    if depth_max == 0:
        return NO_FOREST
    scored = yield ScoreCall(roots_of(state), [])
    logq, support = scored.roots, scored.support
    assert logq is not None
    parent_ok, sigma = alive, state.score
    layers, tables, probs = [], [], []
    level = 0
    while level < depth_max:  # no `for` iterator across a yield: Dynamo 2.11 loses it
        level += 1
        ok = parent_ok & (depth >= level)[:, None]
        drawn = layer_fn(sigma, logq, ok, config, support, eos, streams.at(level, DRAFT))
        layer, table, prob, sigma, parent_ok = drawn
        layers.append(layer)
        if stop is not None and level < depth_max:
            parent_ok = parent_ok & ~layer_stopped(state, layers, level, stop)
        tables.append(table)
        probs.append(prob)
        if level < depth_max:
            logq = (yield ScoreCall(None, [layer])).layers[0]
    return Forest(layers=layers, tables=tables, probs=probs, support=support)


def draft_layer(
    sigma: torch.Tensor,
    logq: torch.Tensor,
    ok: torch.Tensor,
    config: SamplingConfig,
    support: torch.Tensor | None,
    eos: torch.Tensor,
    source: Source,
) -> Drawn:
    """One draft layer from the draft's log-probs `logq` at its parents (scores `sigma`, `ok`
    the parents that may have children): the layer, its table Q_l, each draft's draw
    probability, the drafts' scores and which of them may be parents next (not EOS).

    Between two draft-model calls, as one function of tensors that reads nothing on the host
    (`tests/algorithm/test_iteration_graph.py` compiles it with `fullgraph=True`).
    """
    width = logq.shape[-1]  # V, or K for a restricted head
    width_s = config.effective_draft_width
    candidates = layer_candidates(sigma, logq, ok)
    table = joint_filter(candidates, config.temperature, config.top_k, config.top_p)
    if config.mode == "distinct":
        index, prob, exists = draw_distinct(table, width_s, source)
    else:
        index, exists = draw_with_replacement(table, width_s, source)
        prob = table.gather(1, index)
    token = index % width if support is None else support[index % width]
    layer = ForestLayer(parent=index // width, token=token, exists=exists)
    sigma = torch.where(exists, Scores(sigma, logq).of(index), 0.0)
    return layer, table, prob, sigma, exists & ~torch.isin(layer.token, eos)
