"""Target side of an iteration (ALGORITHM.md §4): one forest forward, then the layers in order.

For each layer l = 1, 2, ... the target distribution P_l over (valid parents x vocabulary) is
formed from the target's log-probabilities at the layer's parents; the layer gets a width K
(fixed: the remaining width R; dynamic: the threshold rule of ALGORITHM.md §5) and is verified
(`verify.verify_layer`). A layer with K acceptances passes and its accepted drafts become the
next layer's parents; the first layer that fails ends the session's iteration and fills the
output slots (`verify.fill_failed_layer`). A session whose drafted layers all passed draws a
bonus layer from P at the deepest layer. Accepted drafts ending in EOS leave for the pool and
take their slot with them; a passed layer whose accepted beams all finished is refilled from P.

Sessions of a batch stop at different layers; `_Walk` keeps which are still verifying. Where
each draw's numbers come from is part of the contract (seeded decodes are reproducible, and the
distributed path draws exactly what the in-process one draws): the bonus, acceptance, fill and
refill draws of each layer, and the dynamic width's estimate, have a stream of their own
(`streams.py`), and a draw is a hash of what it is for, so whether a draw runs (the host skips
what no session needs, a device draws always) moves no other draw.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.candidates import Scores, layer_candidates
from dsbd_core.algorithm.draws.distributions import joint_filter
from dsbd_core.algorithm.draws.host_reads import may_read
from dsbd_core.algorithm.draws.streams import ACCEPT, BONUS, FILL, REFILL, WIDTH, Streams
from dsbd_core.algorithm.iteration.beams import (
    Outputs,
    finds_rows,
    layer_stopped,
    next_beams,
    node_logprobs,
    pool_add,
    sequences,
    slot_logprobs,
    walk_outcome,
)
from dsbd_core.algorithm.iteration.verify import (
    LayerVerdict,
    draw_slots,
    fill_failed_layer,
    verify_layer,
)
from dsbd_core.algorithm.iteration.width import layer_width
from dsbd_core.algorithm.iteration.width_distinct import distinct_layer_width
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ScoreCall
from dsbd_core.algorithm.sequences.logprobs import ForestLogprobTable, IterationLogprobs, Segment
from dsbd_core.algorithm.sequences.state import (
    DecodeState,
    Forest,
    Outcome,
    Pool,
    deepest_layer,
    roots_of,
    zero_counters,
)
from dsbd_core.algorithm.sequences.stops import StopStrings


def verify_forest(
    state: DecodeState,
    forest: Forest,
    config: SamplingConfig,
    vocab: int,
    eos: torch.Tensor,
    streams: Streams,
    verify: Callable[..., Outcome] | None = None,
    *,
    stop: StopStrings | None = None,
) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
    """Score the forest in one target call and verify it layer by layer (with `verify`, the
    same function run another way: `side_graphs.SideGraph`; `stop`: stop strings finish
    beams too, `stops.py`)."""
    assert state.depth is not None, "plan the iteration first (Engine.next_iteration)"
    roots = roots_of(state)
    scored = yield ScoreCall(roots, list(forest.layers))
    assert scored.roots is not None
    node_logp = [scored.roots] + list(scored.layers)
    args = (state, forest, node_logp, config, vocab, eos, streams, deepest_layer(state))
    if stop is not None:  # never the graph (the engine asks for none): it reads on the host
        return verify_scored(*args, stop=stop)
    return (verify_scored if verify is None else verify)(*args)  # no truth of a function


def verify_scored(
    state: DecodeState,
    forest: Forest,
    node_logp: list[torch.Tensor],
    config: SamplingConfig,
    vocab: int,
    eos: torch.Tensor,
    streams: Streams,
    deepest: int,
    stop: StopStrings | None = None,
) -> Outcome:
    """Verify the scored forest layer by layer (`node_logp`: the target's log-probs at the
    roots, then at each layer's nodes; `deepest`: the planned deepest layer).

    Everything after the target's forward, as one function of tensors: on a device, without
    log-probs, it reads no value on the host, so it is one graph
    (`tests/algorithm/test_iteration_graph.py` compiles it with `fullgraph=True`).
    """
    batch = state.alive.shape[0]
    counters = zero_counters(batch, state.alive.device)
    counters["target"] += state.alive.any(dim=1).long()
    assert state.depth is not None, "plan the iteration first (Engine.next_iteration)"
    counters["draft"] += state.depth  # layers drafted: 0 where a session does not decode
    for layer in forest.layers:
        counters["proposed"] += layer.exists.sum(dim=1)
    # The tables stay in the dtype the scorer returns: float64 for float64 models (exactness
    # tests), float32 otherwise (bfloat16/float32 models: every table op costs half). Scores
    # (log-likelihoods) are always accumulated in float64 (`_Walk.scores`).
    walk = _Walk(state, forest, config, vocab, eos, streams, counters, stop)
    if config.logprobs is not None:  # asked for: the values come from these same rows
        walk.table = ForestLogprobTable(node_logp, forest.layers, config.logprobs)
    for level in range(1, deepest + 2):
        if not walk.step(level, node_logp[level - 1]):
            break
    return walk.outcome()


class _Walk:
    """One iteration's verification in progress: which sessions still verify, their parents."""

    def __init__(
        self,
        state: DecodeState,
        forest: Forest,
        config: SamplingConfig,
        vocab: int,
        eos: torch.Tensor,
        streams: Streams,
        counters: dict[str, torch.Tensor],
        stop: StopStrings | None = None,
    ) -> None:
        self.stop = stop
        self.state, self.forest, self.config, self.vocab, self.eos = (
            state,
            forest,
            config,
            vocab,
            eos,
        )
        self.streams, self.counters = streams, counters
        assert state.depth is not None
        self.depth = state.depth
        batch, self.width = state.alive.shape
        self.live = state.alive.any(dim=1)
        self.out = Outputs.empty(batch, self.width, state.alive.device)
        self.valid, self.parent_score = state.alive.clone(), state.score.clone()
        self.remaining = state.remaining
        self.pending = self.live.clone()  # sessions whose output slots are still open
        self.passed_layers = torch.zeros(batch, dtype=torch.long, device=state.alive.device)
        self.widths: list[torch.Tensor] = []
        self.alphas: list[torch.Tensor] = []
        self.finished = Pool()
        self.table: ForestLogprobTable | None = None  # config.logprobs set
        self.finished_logprobs: list[Segment] = []  # one per pool_add into self.finished

    @property
    def distinct(self) -> bool:
        return self.config.mode == "distinct"

    def step(self, level: int, logp: torch.Tensor) -> bool:
        """Layer `level`: bonus slots for sessions past their depth, else verification.
        Returns False when no session is left to verify.

        On the host, work no session needs is skipped (a read of a mask); on a device every
        layer up to the deepest drafted one runs, its draws taken and selected with `where`
        (each draw has its own stream, so skipping one moves no other: `streams.py`)."""
        read = may_read(self.pending)
        if read and not bool(self.pending.any()):
            return False
        cfg = self.config
        candidates = layer_candidates(self.parent_score, logp, self.valid)
        target = joint_filter(candidates, cfg.temperature, cfg.top_k, cfg.top_p)
        scores = Scores(self.parent_score, logp)
        bonus = self.pending & (self.depth < level)
        if not read or bool(bonus.any()):
            index, exists = draw_slots(
                target, self.width, self.remaining, self.distinct, self.streams.at(level, BONUS)
            )
            self.out.set(bonus, level - 1, index, exists, scores.of(index))
            self.pending &= ~bonus
        verifying = self.pending & (self.depth >= level)
        if level > len(self.forest.layers) or (read and not bool(verifying.any())):
            return False  # every pending session took its bonus layer here
        self._verify(level, target, scores, verifying)
        return True

    def _verify(
        self, level: int, target: torch.Tensor, scores: Scores, verifying: torch.Tensor
    ) -> None:
        """Verify drafted layer `level` for the `verifying` sessions."""
        layer = self.forest.layers[level - 1]
        table = self.forest.full_table(level, self.vocab).to(target.dtype)  # float32 -> float64
        probs = self.forest.probs[level - 1]
        drafts = layer.parent * self.vocab + layer.token
        # None: every parent valid (the common case on the host; no N-wide mask to build or
        # apply); a device builds the mask rather than wait to learn it is all true
        all_valid = may_read(self.valid) and bool(self.valid.all())
        valid_rows = None if all_valid else self.valid.repeat_interleave(self.vocab, dim=1)
        parent_valid = self.valid.gather(1, layer.parent) & layer.exists
        self.counters["drafted"] += (parent_valid & verifying[:, None]).sum(dim=1)
        in_layer = torch.where(verifying, layer.exists.sum(dim=1), 0)
        small = self._on_support(level, target, valid_rows)
        k = self._layer_width(level, *(small or (target, table, valid_rows)), in_layer)
        self.widths.append(torch.where(verifying, k, -1))
        # alpha_1 = sum min(P_l, Q_l) = 1 - TV: first-draft acceptance (theory predictor)
        p_alpha, q_alpha = (small[0], small[1]) if small else (target, table)
        alpha = torch.minimum(p_alpha, q_alpha).sum(dim=1)
        self.alphas.append(torch.where(verifying, alpha, -1.0))
        verdict = verify_layer(
            target,
            table,
            valid_rows,
            drafts,
            probs,
            layer.exists,
            parent_valid,
            k,
            verifying,
            self.distinct,
            self.streams.at(level, ACCEPT),
            epsilon=self.config.epsilon,
        )
        self.counters["accepted"] += verdict.count * verifying
        self.counters["epsilon_bias"] += torch.where(verifying, verdict.bias, 0.0)
        passed = verifying & (verdict.count == k)
        failed = verifying & ~passed
        if not may_read(failed) or bool(failed.any()):
            index, exists = fill_failed_layer(
                verdict,
                drafts,
                target,
                self.width,
                self.remaining,
                self.distinct,
                self.streams.at(level, FILL),
            )
            self.out.set(failed, level - 1, index, exists, scores.of(index))
            self.pending &= ~failed
        self._passed(level, layer, target, scores, drafts, verdict, passed)

    def _on_support(
        self, level: int, target: torch.Tensor, valid_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The layer on the draft's support only, when its head is restricted: (P, Q, valid)
        over the support's candidates plus ONE column holding the target's mass outside it.

        Where Q = 0 the width rules only see P's total (no draft lands there; a residual leaves
        it as it is), so one column stands for all of it exactly, and the width estimate and
        the DP run on W x K candidates instead of W x V (FR-Spec's K is a fifth of Qwen's V).
        """
        support = self.forest.support
        if support is None:
            return None
        batch, k = target.shape[0], support.numel()
        parents = target.shape[1] // self.vocab
        p = target.view(batch, parents, self.vocab)[:, :, support].reshape(batch, -1)
        outside = (target.sum(dim=1) - p.sum(dim=1)).clamp_min(0.0)
        q = self.forest.tables[level - 1].to(target.dtype)
        p = torch.cat([p, outside[:, None]], dim=1)
        q = torch.cat([q, q.new_zeros(batch, 1)], dim=1)
        valid = None
        if valid_rows is not None:
            on = valid_rows.view(batch, parents, self.vocab)[:, :, support].reshape(batch, -1)
            valid = torch.cat([on, on.new_ones(batch, 1)], dim=1)
        assert p.shape[1] == parents * k + 1
        return p, q, valid

    def _layer_width(
        self,
        level: int,
        target: torch.Tensor,
        table: torch.Tensor,
        valid_rows: torch.Tensor | None,
        in_layer: torch.Tensor,
    ) -> torch.Tensor:
        """K per session: the remaining width, or the dynamic-width rule (ALGORITHM.md §5) over the
        layer's draft slots (a bound on every session's drafts known without reading them)."""
        cfg = self.config
        slots = self.forest.layers[level - 1].token.shape[1]
        if cfg.fixed_width:
            return self.remaining.clone()
        assert cfg.threshold is not None  # not fixed_width
        if self.distinct:  # the DP assumes i.i.d. drafts: simulate the distinct rule
            return distinct_layer_width(
                target,
                table,
                valid_rows,
                in_layer,
                slots,
                cfg.threshold,
                cfg.w_min,
                self.remaining,
                self.streams.at(level, WIDTH),
            )
        restricted = table * valid_rows if valid_rows is not None else table
        return layer_width(
            target, restricted, in_layer, slots, cfg.threshold, cfg.w_min, self.remaining
        )

    def _passed(
        self,
        level: int,
        layer: ForestLayer,
        target: torch.Tensor,
        scores: Scores,
        drafts: torch.Tensor,
        verdict: LayerVerdict,
        passed: torch.Tensor,
    ) -> None:
        """Accepted drafts of passed layers become the next parents; EOS ones (and those whose
        text holds a stop string) leave."""
        self.passed_layers += passed.long()
        accepted = verdict.accepted & passed[:, None]
        node_score = scores.of(drafts)
        finished_here = accepted & torch.isin(layer.token, self.eos)
        if self.stop is not None:
            stopped = layer_stopped(self.state, self.forest.layers, level, self.stop)
            finished_here = finished_here | (accepted & stopped)
        compact = finds_rows(finished_here, self.table is not None)
        if not compact or bool(finished_here.any()):
            self._pool_finished(level, layer, node_score, finished_here, compact)
        self.valid = accepted & ~finished_here
        self.parent_score = node_score
        # Every accepted beam of the layer finished. With width left (dynamic width: K < R)
        # the open slots are fresh draws from P_l, exactly as in the fail branch.
        emptied = passed & ~self.valid.any(dim=1)
        refill = emptied & (self.remaining > 0)
        if not may_read(refill) or bool(refill.any()):
            rest = target * ~verdict.chosen if self.distinct else target
            index, exists = draw_slots(
                rest, self.width, self.remaining, self.distinct, self.streams.at(level, REFILL)
            )
            self.out.set(refill, level - 1, index, exists, scores.of(index))
        self.pending &= ~emptied

    def _pool_finished(
        self,
        level: int,
        layer: ForestLayer,
        node_score: torch.Tensor,
        finished_here: torch.Tensor,
        compact: bool,
    ) -> None:
        """Accepted drafts of layer `level` that end in EOS leave for the pool and take their
        slot with them."""
        state = self.state
        seq, seq_len = sequences(
            state.tokens,
            state.length,
            self.forest.layers,
            torch.full_like(self.depth, level),
            torch.arange(layer.token.shape[1], device=layer.token.device).expand_as(layer.token),
        )
        pool_add(
            self.finished,
            seq,
            seq_len,
            state.prompt_len,
            node_score,
            finished_here,
            True,
            self.config.max_new_tokens,
            compact=compact,
        )
        if self.table is not None:
            self.finished_logprobs.append(node_logprobs(self.table, level, finished_here))
        self.remaining = self.remaining - finished_here.sum(dim=1)

    def outcome(self) -> Outcome:
        """The next input beams from the filled output slots, and what to count."""
        state, out = self.state, self.out
        produced = out.exists.any(dim=1)
        emitted = torch.where(produced, out.layer + 1, self.passed_layers) * self.live
        beams = next_beams(
            state.tokens,
            state.length,
            state.prompt_len,
            self.forest.layers,
            out,
            self.remaining,
            self.live,
            self.finished,
            vocab=self.vocab,
            eos=self.eos,
            lean_memory=self.config.lean_memory,
            max_new_tokens=self.config.max_new_tokens,
            rows_needed=self.table is not None,
            stop=self.stop,
        )
        logprobs = None
        if self.table is not None:
            next_part, done = slot_logprobs(self.table, out, beams, beams.finished, self.vocab)
            pooled = self.finished_logprobs + ([done] if done is not None else [])
            logprobs = IterationLogprobs(next_part, pooled)
        return walk_outcome(
            beams,
            emitted=emitted,
            finished=self.finished,
            passed_layers=self.passed_layers,
            widths=self.widths,
            alphas=self.alphas,
            counters=self.counters,
            logprobs=logprobs,
        )
