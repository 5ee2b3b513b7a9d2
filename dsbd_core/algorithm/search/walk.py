"""Speculative deterministic beam search: the draft's beams, verified so that the output is the
target's own beam search token for token (docs/ALGORITHM.md, "Beam search").

Draft side (`draft_search`): from the current running beams (with their *target* scores) the
draft runs the same search rule for `depth` layers on its own log-probs: each layer keeps its
W_S best candidates that do not end in EOS (the target's running beams never do; the last step,
max_new_tokens, is never drafted). No tables or draw probabilities: nothing is sampled.

Target side (`verify_search`): one forward over the forest gives the target's log-probs at the
roots and at every drafted node. Layer by layer the target takes its own search step
(`search.search_step`) from its running beams; if every beam it keeps is a drafted node of the
next layer, it has the log-probs there already and steps on (the layer passes); otherwise its
running beams are the iteration's output and the next iteration starts from them. A session
whose drafted layers all pass takes one more step at the deepest layer (the bonus). So a
passed layer saves a target forward and a failed one costs nothing but the draft's work:
correctness never depends on the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.candidates import Scores, layer_candidates
from dsbd_core.algorithm.draws.distributions import NEG_INF
from dsbd_core.algorithm.draws.host_reads import may_read
from dsbd_core.algorithm.draws.streams import Streams
from dsbd_core.algorithm.iteration.beams import (
    Outputs,
    finds_rows,
    next_beams,
    path_logprobs,
    pool_add,
    sequences,
    slot_logprobs,
    walk_outcome,
)
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.search.sampled import verified_candidates
from dsbd_core.algorithm.search.step import SearchStep, search_step
from dsbd_core.algorithm.sequences.logprobs import ForestLogprobTable, IterationLogprobs, Segment
from dsbd_core.algorithm.sequences.state import (
    NO_FOREST,
    DecodeState,
    Forest,
    Outcome,
    Pool,
    deepest_layer,
    roots_of,
    zero_counters,
)
from dsbd_core.algorithm.sequences.stops import StopStrings


def draft_search(
    state: DecodeState, config: SamplingConfig, eos: torch.Tensor
) -> Generator[ScoreCall, ForestLogprobs, Forest]:
    """The draft's beam search for up to `state.depth[b]` layers: one draft call per layer."""
    assert state.depth is not None, "plan the iteration first (Engine.next_iteration)"
    depth = state.depth
    depth_max = deepest_layer(state)
    if depth_max == 0:
        return NO_FOREST
    scored = yield ScoreCall(roots_of(state), [])
    logq, support = scored.roots, scored.support
    assert logq is not None
    width = logq.shape[-1]  # V, or K for a restricted head
    columns = torch.arange(width, device=logq.device) if support is None else support
    is_eos = torch.isin(columns, eos)
    parent_ok, sigma = state.alive, state.score
    layers = []
    level = 0
    while level < depth_max:  # no `for` iterator across a yield: Dynamo 2.11 loses it
        level += 1
        ok = parent_ok & (depth >= level)[:, None]
        weights = layer_candidates(sigma, logq, ok).view(ok.shape[0], -1, width)
        weights = weights.masked_fill_(is_eos, NEG_INF).view(ok.shape[0], -1)
        top = weights.topk(min(config.effective_draft_width, weights.shape[1]), dim=1)
        exists = torch.isfinite(top.values)
        index = top.indices
        layer = ForestLayer(parent=index // width, token=columns[index % width], exists=exists)
        layers.append(layer)
        sigma = torch.where(exists, Scores(sigma, logq).of(index), 0.0)
        parent_ok = exists
        if level < depth_max:
            logq = (yield ScoreCall(None, [layer])).layers[0]
    return Forest(layers=layers, tables=[], probs=[], support=support)


def verify_search(
    state: DecodeState,
    forest: Forest,
    config: SamplingConfig,
    vocab: int,
    eos: torch.Tensor,
    streams: Streams | None = None,
    stop: StopStrings | None = None,
    then: Callable[[Outcome], Outcome] | None = None,
) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
    """Score the forest in one target call; take the target's search steps through it
    (`streams`: where a sampled step draws, transformers' law; `stop`: stop strings end
    hypotheses as EOS does; `then`: applied to the outcome before it is returned)."""
    assert state.depth is not None and state.finished_scores is not None
    scored = yield ScoreCall(roots_of(state), list(forest.layers))
    assert scored.roots is not None
    walk = _SearchWalk(state, forest, config, vocab, eos, streams)
    walk.stop = stop
    walk.counters["target"] += state.alive.any(dim=1).long()
    walk.counters["draft"] += state.depth  # layers drafted: 0 where a session does not decode
    for layer in forest.layers:
        walk.counters["proposed"] += layer.exists.sum(dim=1)
    node_logp = [scored.roots] + list(scored.layers)
    if config.logprobs is not None:
        walk.table = ForestLogprobTable(node_logp, forest.layers, config.logprobs)
    for level in range(1, deepest_layer(state) + 2):
        if may_read(walk.pending) and not bool(walk.pending.any()):
            break  # on a device every level steps, under the mask (`host_reads`)
        walk.step(level, node_logp[level - 1])
    outcome = walk.outcome()
    return then(outcome) if then is not None else outcome


class _SearchWalk:
    """One iteration's search steps in progress: which sessions still step, their beams."""

    def __init__(
        self,
        state: DecodeState,
        forest: Forest,
        config: SamplingConfig,
        vocab: int,
        eos: torch.Tensor,
        streams: Streams | None,
    ) -> None:
        assert state.depth is not None and state.finished_scores is not None
        self.streams = streams
        self.state, self.forest, self.config, self.vocab, self.eos = (
            state,
            forest,
            config,
            vocab,
            eos,
        )
        batch, self.width = state.alive.shape
        device = state.alive.device
        self.counters = zero_counters(batch, device)
        self.live = state.alive.any(dim=1)
        self.pending = self.live.clone()
        self.valid, self.parent_score = state.alive.clone(), state.score.clone()
        self.finished_scores = state.finished_scores.clone()
        self.out = Outputs.empty(batch, self.width, device)
        self.passed_layers = torch.zeros(batch, dtype=torch.long, device=device)
        self.widths: list[torch.Tensor] = []
        self.finished = Pool()
        self.table: ForestLogprobTable | None = None
        self.finished_logprobs: list[Segment] = []
        self.stop: StopStrings | None = None

    def _stopped(self, level: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Which candidates of step `level` (flat indices over the rows of layer `level - 1`)
        finish by a stop string; None without stop strings."""
        stop = self.stop
        if stop is None:
            return None
        state, vocab = self.state, self.vocab

        def stopped(indices: torch.Tensor) -> torch.Tensor:
            parent, token = indices // vocab, indices % vocab
            at = torch.full_like(state.length, level - 1)
            seq, seq_len = sequences(state.tokens, state.length, self.forest.layers, at, parent)
            where = seq_len[:, None, None].expand(-1, parent.shape[1], 1)
            seq.scatter_(2, where, token[:, :, None])
            return stop.finished(seq, seq_len + 1, state.prompt_len)

        return stopped

    def step(self, level: int, logp: torch.Tensor) -> None:
        """The target's search step at depth `level` from its running beams (rows of layer
        `level - 1`), for the sessions still pending."""
        state = self.state
        generated = state.length - state.prompt_len + level
        valid = self.valid & self.pending[:, None]
        drawn = None
        if self.config.selection == "transformers":  # transformers' law (sampled_search.py)
            assert self.streams is not None, "a sampled step draws"
            verifying = self.pending & (state.depth >= level)  # type: ignore[operator]  # a planned state has its depth
            drawn = verified_candidates(
                level,
                self.parent_score,
                logp,
                valid,
                verifying,
                self.forest,
                self.config,
                self.eos,
                self.streams,
            )
        step = search_step(
            self.parent_score,
            logp,
            valid,
            generated,
            self.finished_scores,
            self.eos,
            self.config,
            drawn=drawn,
            stopped=self._stopped(level),
        )
        pending = self.pending
        self.finished_scores = torch.where(
            pending[:, None], step.finished_scores, self.finished_scores
        )
        self._pool(level, step, pending)
        onward = pending & ~step.done & (self.state.depth >= level)  # type: ignore[operator]  # a planned state has its depth
        if level <= len(self.forest.layers) and (not may_read(onward) or bool(onward.any())):
            onward = onward & self._follow(level, step, onward)
        else:
            onward = torch.zeros_like(onward)  # past the forest: nothing to follow
        stop = pending & ~onward
        self.out.set(
            stop,
            level - 1,
            step.running,
            step.running_exists & ~step.done[:, None],
            step.running_score,
        )
        self.pending = onward

    def _pool(self, level: int, step: SearchStep, pending: torch.Tensor) -> None:
        """Finished hypotheses of this step that are among the W best go to the pool."""
        pooled = step.pooled & pending[:, None]
        if may_read(pooled) and not bool(pooled.any()):
            return
        state, layers = self.state, self.forest.layers
        parent, token = step.candidates // self.vocab, step.candidates % self.vocab
        at = torch.full_like(state.length, level - 1)
        seq, seq_len = sequences(state.tokens, state.length, layers, at, parent)
        seq.scatter_(2, seq_len[:, None, None].expand(-1, parent.shape[1], 1), token[:, :, None])
        by_eos = pooled & step.pooled_eos
        for finished, mask in ((True, by_eos), (False, pooled & ~by_eos)):
            if may_read(mask) and not bool(mask.any()):
                continue
            pool_add(
                self.finished,
                seq,
                seq_len + 1,
                state.prompt_len,
                step.candidate_score,
                mask,
                finished,
                self.config.max_new_tokens,
                compact=finds_rows(mask, self.table is not None),
            )
            if self.table is not None:
                self.finished_logprobs.append(path_logprobs(self.table, at, parent, token, mask))

    def _follow(self, level: int, step: SearchStep, onward: torch.Tensor) -> torch.Tensor:
        """[B] whether every running beam of the target is a drafted node of layer `level`
        (for the `onward` sessions); where so, those nodes become the next parents."""
        layer = self.forest.layers[level - 1]
        keys = torch.where(layer.exists, layer.parent * self.vocab + layer.token, -1)
        same = (step.running[:, :, None] == keys[:, None, :]) & step.running_exists[:, :, None]
        found = same.any(dim=2) | ~step.running_exists  # [B, W]
        parent_valid = self.valid.gather(1, layer.parent) & layer.exists
        self.counters["drafted"] += (parent_valid & onward[:, None]).sum(dim=1)
        kept = same.any(dim=1) & onward[:, None]  # [B, M] drafted nodes the target keeps
        self.counters["accepted"] += kept.sum(dim=1)
        passed = onward & found.all(dim=1)
        self.widths.append(torch.where(onward, step.running_exists.sum(dim=1), -1))
        self.passed_layers += passed.long()
        # each node is at most one running beam: the sum picks its score exactly
        self.parent_score = (same.to(torch.float64) * step.running_score[:, :, None]).sum(dim=1)
        self.valid = kept & passed[:, None]
        return passed

    def outcome(self) -> Outcome:
        """The next running beams from the output slots, and what to count."""
        state, out = self.state, self.out
        produced = out.layer + 1
        emitted = produced * self.live
        none = torch.zeros(0, dtype=torch.long, device=emitted.device)
        beams = next_beams(
            state.tokens,
            state.length,
            state.prompt_len,
            self.forest.layers,
            out,
            state.remaining,
            self.live,
            self.finished,
            vocab=self.vocab,
            eos=none,
            lean_memory=False,
            max_new_tokens=self.config.max_new_tokens,
        )
        logprobs = None
        if self.table is not None:
            nothing = torch.zeros_like(out.exists)  # running beams never end in EOS
            segment, _ = slot_logprobs(self.table, out, beams, nothing, self.vocab)
            logprobs = IterationLogprobs(segment, self.finished_logprobs)
        return walk_outcome(
            beams,
            emitted=emitted,
            finished=self.finished,
            passed_layers=self.passed_layers,
            widths=self.widths,
            alphas=[],
            counters=self.counters,
            logprobs=logprobs,
            finished_scores=self.finished_scores,
        )
