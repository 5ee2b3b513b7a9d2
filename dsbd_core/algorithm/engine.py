"""The decoding engine: beam sampling and DSBD over a batch of independent sessions.

One engine runs every decoder of the project (multinomial sampling = beam sampling with W = 1;
SpS = DSBD with W = W_S = 1 and fixed width), so a statement such as "DSBD follows beam
sampling" compares two configurations of the same state machine, and the exactness tests can run
1e5 sessions in one batched call on an exact n-gram table.

Per iteration (spec §2): the draft runs beam sampling of width W_S for gamma layers from the
input beams (starting from their *target* scores, with the same temperature and joint filter as
the target, so draft == target gives Q == P); the target scores the whole forest in one forward;
layers are verified in order (dsbd_core/algorithm/verify.py) with a fixed or dynamic width
(dsbd_core/algorithm/width.py); the first layer that gets fewer than K acceptances ends the
iteration and
fills the output slots; if all layers pass a bonus layer is drawn. Beams ending in an EOS token
are moved to the finished pool and never extended; each such beam takes its slot with it
(the remaining width R shrinks), in beam sampling and in DSBD alike.

Scores are true cumulative target log-likelihoods of the generated tokens; the candidate table
of a step is exp((score + log p) / T) jointly filtered, i.e. beam sampling from the tempered
sequence distribution (spec §11.3, §11.7).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, replace

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.distributions import draw_distinct, draw_with_replacement, joint_filter
from dsbd_core.algorithm.result import Beam, DecodeResult, DecodeStats
from dsbd_core.algorithm.scorer import (
    ForestLayer,
    ForestLogprobs,
    ForestScorer,
    Origin,
    Roots,
    ScoreCall,
    drive,
)
from dsbd_core.algorithm.verify import draw_slots, fill_failed_layer, verify_layer
from dsbd_core.algorithm.width import layer_width
from dsbd_core.algorithm.width_distinct import distinct_layer_width

NEG_INF = float("-inf")
# Per-session integer counters. "proposed": draft tokens in the forest (every node drafted);
# "drafted": those of them verification reached (a live parent in a verified layer).
_COUNTERS = ("target", "draft", "proposed", "drafted", "accepted")
# Random streams of an iteration: the two sides, and the width estimate of distinct drafts
# (its own stream, so choosing a width never moves the verification's uniforms).
_DRAFT_STREAM, _VERIFY_STREAM, _WIDTH_STREAM = 1, 2, 3


@dataclass
class _Pool:
    """Beams that left decoding (finished at EOS, or alive when the budget ran out)."""

    session: list[torch.Tensor] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)  # generated tokens, padded
    length: list[torch.Tensor] = field(default_factory=list)
    score: list[torch.Tensor] = field(default_factory=list)
    finished: list[torch.Tensor] = field(default_factory=list)

    def extend(self, other: _Pool) -> None:
        """Append another pool's beams (an iteration's finished beams to the session's pool)."""
        self.session += other.session
        self.tokens += other.tokens
        self.length += other.length
        self.score += other.score
        self.finished += other.finished


@dataclass
class _Outputs:
    """Output slots of the current iteration, filled layer by layer as sessions stop verifying."""

    layer: torch.Tensor  # [B] forest layer of the output beams' parents
    index: torch.Tensor  # [B, W] flat candidate index (parent * V + token)
    exists: torch.Tensor  # [B, W]
    score: torch.Tensor  # [B, W] true log-likelihood of the output beam


@dataclass
class DecodeState:
    """What a batch of sessions carries between iterations: token ids, scores, flags, counters.

    Small by design: it is what the serving router keeps per request; the models' KV caches live
    with the scorers, the forest only between `propose` and `verify`.
    """

    tokens: torch.Tensor  # [B, W, L] prompt + generated tokens of every input beam
    length: torch.Tensor  # [B]
    prompt_len: torch.Tensor  # [B]
    score: torch.Tensor  # [B, W] true log-likelihood of the generated tokens
    alive: torch.Tensor  # [B, W]
    remaining: torch.Tensor  # [B] width left (W minus finished beams)
    steps: torch.Tensor  # [B] tokens emitted so far
    origin: Origin | None
    pool: _Pool
    counters: dict[str, torch.Tensor]
    seed: int = 0  # base of every random stream (config.seed, or drawn once at start)
    iteration: int = 0  # iterations advanced so far
    history: list[dict[str, torch.Tensor]] = field(default_factory=list)
    live: torch.Tensor | None = None  # [B] sessions decoding in the current iteration
    depth: torch.Tensor | None = None  # [B] layers drafted in the current iteration

    def for_models(self) -> DecodeState:
        """What the draft and the verifier need of the state: no pool, history or counters.

        This is the message a serving router sends each iteration (a few KiB): the beams'
        tokens, scores and flags, the planned depth, and the `Origin` the caches compact from.
        """
        return replace(self, pool=_Pool(), counters={}, history=[])


@dataclass
class Forest:
    """The draft's proposal for one iteration (spec §3): travels from draft to verifier."""

    layers: list[ForestLayer]
    tables: list[torch.Tensor]  # per layer: the full draft table Q_l [B, parents x V]
    probs: list[torch.Tensor]  # per layer: exact draw probability of every draft [B, W_S]


@dataclass
class Outcome:
    """What verification of one iteration returns: the next input beams and what to count.

    Computed on the verifier's side (it holds the forest), so the caller never needs the forest.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    score: torch.Tensor
    alive: torch.Tensor
    remaining: torch.Tensor
    origin: Origin
    emitted: torch.Tensor  # [B] tokens each session's beams grew by
    finished: _Pool  # beams that left decoding this iteration
    record: dict[str, torch.Tensor]  # accepted_layers, widths, alphas (per session)
    counters: dict[str, torch.Tensor]  # increments: _COUNTERS (less "draft"), epsilon_bias


class Engine:
    """Decode a batch of prompts with one configuration.

    `draft=None` runs target beam sampling (gamma = 0). With a draft, DSBD. The sampling config
    is used as given; `dsbd_core.algorithm.decoders` maps method names (sample, beam, sps, dsbd) to
    configs.

    `run` decodes to the end. The same iteration is also available as steps, which is how the
    serving layer distributes it: `start`, then while `next_iteration`: `propose` (draft side)
    -> `verify` (target side) -> `advance` (the caller); `finish` builds the results.
    `propose_steps` / `verify_steps` are the same two sides as generators of `ScoreCall`s, so a
    replica can answer the model calls of many requests with one batched forward.
    """

    def __init__(
        self, target: ForestScorer, config: SamplingConfig, draft: ForestScorer | None = None
    ) -> None:
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft vocabulary size {draft.vocab_size} != target vocabulary size "
                f"{target.vocab_size}: draft and target must share a vocabulary"
            )
        self.target = target
        self.draft = draft
        self.config = config
        self.vocab = target.vocab_size
        self.generator = torch.Generator()  # reseeded per iteration and side, see _reseed
        self.width_generator = torch.Generator()  # distinct-draft width estimates, ditto
        self.eos = torch.tensor(sorted(set(config.eos_token_ids)), dtype=torch.long)

    # ------------------------------------------------------------------ public
    def run(self, prompts: list[list[int]]) -> list[DecodeResult]:
        """Decode every prompt (an independent session); returns one result per prompt."""
        state = self.start(prompts)
        try:
            while self.next_iteration(state):
                self.advance(state, self.verify(state, self.propose(state)))
        finally:
            self.target.release()
            if self.draft is not None:
                self.draft.release()
        return self.finish(state)

    def start(self, prompts: list[list[int]]) -> DecodeState:
        """The state before the first iteration: one input beam per session, the prompt."""
        self._check_prompts(prompts)
        cfg = self.config
        batch, width = len(prompts), cfg.width
        gamma = cfg.gamma if self.draft is not None else 0
        prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        capacity = int(prompt_len.max()) + cfg.max_new_tokens + gamma + 2
        longest = int(prompt_len.max())
        padded = torch.tensor([p + [0] * (longest - len(p)) for p in prompts], dtype=torch.long)
        tokens = torch.zeros(batch, width, capacity, dtype=torch.long)
        tokens[:, :, :longest] = padded[:, None, :]
        alive = torch.zeros(batch, width, dtype=torch.bool)
        alive[:, 0] = True  # one input beam at the start (spec §11.6: no replicated prompt rows)
        counters = {name: torch.zeros(batch, dtype=torch.long) for name in _COUNTERS}
        counters["epsilon_bias"] = torch.zeros(batch, dtype=torch.float64)
        return DecodeState(
            tokens=tokens,
            length=prompt_len.clone(),
            prompt_len=prompt_len,
            score=torch.zeros(batch, width, dtype=torch.float64),
            alive=alive,
            remaining=torch.full((batch,), width, dtype=torch.long),
            steps=torch.zeros(batch, dtype=torch.long),
            origin=None,
            pool=_Pool(),
            counters=counters,
            seed=cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, ()).item()),
        )

    def next_iteration(self, state: DecodeState, gamma: int | None = None) -> bool:
        """Retire beams whose budget is spent and plan the next iteration's depth per session.

        `gamma` overrides the config's draft depth for this iteration only (0 = no draft, a plain
        beam-sampling step; any depth keeps fixed-width DSBD exact), which is how a width
        controller adapts speculation per iteration. Returns False when nothing is left to decode.
        """
        if self.draft is None:
            gamma = 0
        elif gamma is None:
            gamma = self.config.gamma
        budget = self.config.max_new_tokens - (state.length - state.prompt_len)
        live = (state.remaining > 0) & (budget > 0) & state.alive.any(dim=1)
        retired = state.alive & ~live[:, None]  # budget spent: the beams leave unfinished
        if bool(retired.any()):
            self._pool_add(state.pool, state.tokens, state.length, state.prompt_len, state.score,
                           retired, False)  # fmt: skip
            state.alive = state.alive & live[:, None]
        state.live = live
        # never overshoot the budget: an iteration emits at most depth + 1 tokens
        state.depth = torch.where(live, (budget - 1).clamp(max=gamma), torch.zeros_like(budget))
        return bool(live.any())

    def propose(self, state: DecodeState) -> Forest:
        """Draft side: beam-sample the forest from the current input beams (spec §3)."""
        # Without a draft the generator yields nothing and returns the empty forest.
        return drive(self.draft or self.target, self.propose_steps(state))

    def verify(self, state: DecodeState, forest: Forest) -> Outcome:
        """Target side: one forward over the forest, layer-by-layer verification (spec §4)."""
        return drive(self.target, self.verify_steps(state, forest))

    def propose_steps(self, state: DecodeState) -> Generator[ScoreCall, ForestLogprobs, Forest]:
        """`propose` as a generator of draft-model calls (one per draft layer)."""
        assert state.depth is not None, "call next_iteration first"
        self._reseed(state, _DRAFT_STREAM)
        layers, tables, probs = yield from self._draft_forest(
            state.tokens, state.length, state.score, state.alive, state.depth, state.origin
        )
        return Forest(layers=layers, tables=tables, probs=probs)

    def verify_steps(
        self, state: DecodeState, forest: Forest
    ) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
        """`verify` as a generator of its one target-model call."""
        assert state.depth is not None, "call next_iteration first"
        self._reseed(state, _VERIFY_STREAM)
        self._reseed(state, _WIDTH_STREAM, self.width_generator)
        return (yield from self._iteration(state, forest))

    def advance(self, state: DecodeState, outcome: Outcome) -> None:
        """Take the verified outcome as the next iteration's input beams."""
        assert state.live is not None and state.depth is not None
        if self.draft is not None:
            state.counters["draft"] += torch.where(state.live, state.depth, 0)
        for name, increment in outcome.counters.items():
            state.counters[name] += increment
        state.pool.extend(outcome.finished)
        state.history.append({"live": state.live, **outcome.record})
        state.iteration += 1
        state.steps += outcome.emitted
        state.tokens, state.length, state.score = outcome.tokens, outcome.length, outcome.score
        state.alive, state.remaining, state.origin = (
            outcome.alive, outcome.remaining, outcome.origin
        )  # fmt: skip

    def finish(self, state: DecodeState) -> list[DecodeResult]:
        """Every session's beams best-first and its statistics."""
        batch = state.tokens.shape[0]
        return self._results(batch, state.pool, state.steps, state.counters, state.history)

    # ------------------------------------------------------------------ one iteration
    def _iteration(
        self, state: DecodeState, forest: Forest
    ) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
        cfg, vocab = self.config, self.vocab
        tokens, length, prompt_len = state.tokens, state.length, state.prompt_len
        score, alive, remaining, depth = state.score, state.alive, state.remaining, state.depth
        assert depth is not None
        layers, tables, probs = forest.layers, forest.tables, forest.probs
        batch, width = alive.shape
        live = alive.any(dim=1)
        depth_max = int(depth.max())
        finished = _Pool()
        counters = {name: torch.zeros(batch, dtype=torch.long) for name in _COUNTERS}
        counters["epsilon_bias"] = torch.zeros(batch, dtype=torch.float64)
        scored = yield ScoreCall(Roots(tokens, length, alive, state.origin), list(layers))
        counters["target"] += live.long()
        for layer in layers:
            counters["proposed"] += layer.exists.sum(dim=1)
        assert scored.roots is not None
        node_logp = [scored.roots.double()] + [lp.double() for lp in scored.layers]

        out = _Outputs(
            layer=torch.zeros(batch, dtype=torch.long),
            index=torch.zeros(batch, width, dtype=torch.long),
            exists=torch.zeros(batch, width, dtype=torch.bool),
            score=torch.zeros(batch, width, dtype=torch.float64),
        )
        valid, parent_score = alive.clone(), score.clone()
        pending = live.clone()
        passed_layers = torch.zeros(batch, dtype=torch.long)
        widths, alphas = [], []
        for level in range(1, depth_max + 2):
            if not bool(pending.any()):
                break
            logp = node_logp[level - 1]
            candidates = (parent_score[:, :, None] + logp).masked_fill(~valid[:, :, None], NEG_INF)
            candidates = candidates.reshape(batch, -1)
            target = joint_filter(candidates, cfg.temperature, cfg.top_k, cfg.top_p)
            bonus = pending & (depth < level)
            if bool(bonus.any()):
                index, exists = draw_slots(target, width, remaining, self.distinct, self.generator)
                self._set_outputs(out, bonus, level - 1, index, exists, candidates)
                pending &= ~bonus
            verifying = pending & (depth >= level)
            if not bool(verifying.any()):
                break  # every pending session took its bonus layer here
            layer = layers[level - 1]
            drafts = layer.parent * vocab + layer.token
            valid_rows = valid.repeat_interleave(vocab, dim=1)
            parent_valid = valid.gather(1, layer.parent) & layer.exists
            counters["drafted"] += (parent_valid & verifying[:, None]).sum(dim=1)
            in_layer = torch.where(verifying, layer.exists.sum(dim=1), 0)
            if cfg.fixed_width:
                k = remaining.clone()
            elif self.distinct:  # the DP assumes i.i.d. drafts: simulate the distinct rule
                k = distinct_layer_width(
                    target, tables[level - 1], valid_rows, in_layer, cfg.threshold, cfg.w_min,
                    remaining, self.width_generator,
                )  # fmt: skip
            else:
                k = layer_width(
                    target, tables[level - 1] * valid_rows, in_layer, cfg.threshold, cfg.w_min,
                    remaining,
                )  # fmt: skip
            widths.append(torch.where(verifying, k, -1))
            # alpha_1 = sum min(P_l, Q_l) = 1 - TV: first-draft acceptance (theory predictor)
            alpha = torch.minimum(target, tables[level - 1]).sum(dim=1)
            alphas.append(torch.where(verifying, alpha, -1.0))
            verdict = verify_layer(
                target, tables[level - 1], valid_rows, drafts, probs[level - 1], layer.exists,
                parent_valid, k, verifying, self.distinct, self.generator, epsilon=cfg.epsilon,
            )  # fmt: skip
            counters["accepted"] += verdict.count * verifying
            counters["epsilon_bias"] += torch.where(verifying, verdict.bias, 0.0)
            passed = verifying & (verdict.count == k)
            failed = verifying & ~passed
            if bool(failed.any()):
                index, exists = fill_failed_layer(
                    verdict, drafts, target, width, remaining, self.distinct, self.generator
                )
                self._set_outputs(out, failed, level - 1, index, exists, candidates)
                pending &= ~failed
            # Passed layers: accepted drafts become the valid parents of the next layer.
            passed_layers += passed.long()
            accepted = verdict.accepted & passed[:, None]
            node_score = candidates.gather(1, drafts)
            finished_here = accepted & self._is_eos(layer.token)
            if bool(finished_here.any()):
                seq, seq_len = self._sequences(
                    tokens, length, layers, torch.full_like(depth, level),
                    torch.arange(layer.token.shape[1]).expand_as(layer.token),
                )  # fmt: skip
                self._pool_add(finished, seq, seq_len, prompt_len, node_score, finished_here, True)
                remaining = remaining - finished_here.sum(dim=1)
            valid = accepted & ~finished_here
            parent_score = node_score
            # Every accepted beam of the layer finished. With width left (dynamic width: K < R)
            # the open slots are fresh draws from P_l, exactly as in the fail branch.
            emptied = passed & ~valid.any(dim=1)
            refill = emptied & (remaining > 0)
            if bool(refill.any()):
                rest = target * ~verdict.chosen if self.distinct else target
                index, exists = draw_slots(rest, width, remaining, self.distinct, self.generator)
                self._set_outputs(out, refill, level - 1, index, exists, candidates)
            pending &= ~emptied
        produced = out.exists.any(dim=1)
        emitted = torch.where(produced, out.layer + 1, passed_layers) * live
        next_tokens, next_length, next_score, next_alive, next_remaining, origin = self._advance(
            tokens, length, prompt_len, layers, out, remaining, live, finished
        )
        return Outcome(
            tokens=next_tokens,
            length=next_length,
            score=next_score,
            alive=next_alive,
            remaining=next_remaining,
            origin=origin,
            emitted=emitted,
            finished=finished,
            record={
                "accepted_layers": passed_layers,
                "widths": torch.stack(widths, dim=1) if widths else torch.empty(batch, 0),
                "alphas": torch.stack(alphas, dim=1) if alphas else torch.empty(batch, 0),
            },
            counters=counters,
        )

    def _draft_forest(
        self,
        tokens: torch.Tensor,
        length: torch.Tensor,
        score: torch.Tensor,
        alive: torch.Tensor,
        depth: torch.Tensor,
        origin: Origin | None,
    ) -> Generator[
        ScoreCall, ForestLogprobs, tuple[list[ForestLayer], list[torch.Tensor], list[torch.Tensor]]
    ]:
        """Draft beam sampling for up to `depth[b]` layers (spec §3).

        Returns the forest layers, each layer's full draft table Q_l ([B, parents x V]) and the
        exact draw probability of every draft (conditional on earlier drafts in distinct mode).
        """
        depth_max = int(depth.max())
        if self.draft is None or depth_max == 0:
            return [], [], []
        cfg, vocab, batch = self.config, self.vocab, alive.shape[0]
        width_s = cfg.draft_beams
        logq = (yield ScoreCall(Roots(tokens, length, alive, origin), [])).roots
        assert logq is not None
        parent_ok, sigma = alive, score
        layers, tables, probs = [], [], []
        for level in range(1, depth_max + 1):
            ok = parent_ok & (depth >= level)[:, None]
            candidates = (sigma[:, :, None] + logq.double()).masked_fill(~ok[:, :, None], NEG_INF)
            candidates = candidates.reshape(batch, -1)
            table = joint_filter(candidates, cfg.temperature, cfg.top_k, cfg.top_p)
            if self.distinct:
                index, prob, exists = draw_distinct(table, width_s, self.generator)
            else:
                index, exists = draw_with_replacement(table, width_s, self.generator)
                prob = table.gather(1, index)
            layer = ForestLayer(parent=index // vocab, token=index % vocab, exists=exists)
            layers.append(layer)
            tables.append(table)
            probs.append(prob)
            sigma = candidates.gather(1, index) * 1.0
            sigma = torch.where(exists, sigma, torch.zeros_like(sigma))
            parent_ok = exists & ~self._is_eos(layer.token)
            if level < depth_max:
                logq = (yield ScoreCall(None, [layer])).layers[0]
        return layers, tables, probs

    # ------------------------------------------------------------------ helpers
    def _reseed(
        self, state: DecodeState, stream: int, generator: torch.Generator | None = None
    ) -> None:
        """Seed the generator (or `generator`) from (seed, iteration, stream).

        Draft and verifier may live in different processes; deriving each side's stream from the
        state (instead of sharing one generator) makes a distributed decode draw exactly what the
        in-process engine draws for the same seed.
        """
        mixed = (state.seed * 1_000_003 + state.iteration * 4 + stream) % (2**63 - 1)
        (generator or self.generator).manual_seed(mixed)

    @property
    def distinct(self) -> bool:
        return self.config.mode == "distinct"

    def _is_eos(self, token: torch.Tensor) -> torch.Tensor:
        return torch.isin(token, self.eos)

    def _set_outputs(
        self,
        out: _Outputs,
        sessions: torch.Tensor,
        layer: int,
        index: torch.Tensor,
        exists: torch.Tensor,
        candidates: torch.Tensor,
    ) -> None:
        """Record the output slots of `sessions`: children of forest layer `layer`."""
        out.layer[sessions] = layer
        out.index[sessions] = index[sessions]
        out.exists[sessions] = exists[sessions]
        out.score[sessions] = candidates.gather(1, index)[sessions]

    def _sequences(
        self,
        tokens: torch.Tensor,
        length: torch.Tensor,
        layers: list[ForestLayer],
        level: torch.Tensor,
        node: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token sequences through forest nodes: root tokens ++ path tokens (layers 1..level).

        level: [B] the nodes' layer (0 = roots); node: [B, n] node indices in that layer.
        Returns (tokens [B, n, L], length [B]).
        """
        root, path = self._ancestry(layers, level, node)
        batch, n = node.shape
        seq = tokens.gather(1, root[:, :, None].expand(-1, -1, tokens.shape[2])).clone()
        for lv in range(1, len(layers) + 1):
            here = level >= lv
            tok = layers[lv - 1].token.gather(1, path[:, :, lv - 1].clamp(min=0))
            pos = (length + lv - 1).clamp(max=tokens.shape[2] - 1)
            current = seq.gather(2, pos[:, None, None].expand(batch, n, 1))[:, :, 0]
            value = torch.where(here[:, None], tok, current)
            seq.scatter_(2, pos[:, None, None].expand(batch, n, 1), value[:, :, None])
        return seq, length + level

    @staticmethod
    def _ancestry(
        layers: list[ForestLayer], level: torch.Tensor, node: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Root row and per-layer node index (-1 above `level`) of every given node."""
        batch, n = node.shape
        path = torch.full((batch, n, len(layers)), -1, dtype=torch.long)
        current = node.clone()
        for lv in range(len(layers), 0, -1):
            here = (level >= lv)[:, None].expand(batch, n)
            path[:, :, lv - 1] = torch.where(here, current, -1)
            parents = layers[lv - 1].parent
            up = parents.gather(1, current.clamp(max=parents.shape[1] - 1))
            current = torch.where(here, up, current)
        return current, path

    def _advance(
        self,
        tokens: torch.Tensor,
        length: torch.Tensor,
        prompt_len: torch.Tensor,
        layers: list[ForestLayer],
        out: _Outputs,
        remaining: torch.Tensor,
        live: torch.Tensor,
        pool: _Pool,
    ) -> tuple:
        """Turn the output slots into the next iteration's input beams."""
        vocab = self.vocab
        batch, width = out.index.shape
        parent, new_token = out.index // vocab, out.index % vocab
        root, path = self._ancestry(layers, out.layer, parent)
        seq, seq_len = self._sequences(tokens, length, layers, out.layer, parent)
        seq.scatter_(2, seq_len[:, None, None].expand(batch, width, 1), new_token[:, :, None])
        seq_len = torch.where(live, seq_len + 1, length)
        exists = out.exists & live[:, None]
        finished = exists & self._is_eos(new_token)
        if bool(finished.any()):
            self._pool_add(pool, seq, seq_len, prompt_len, out.score, finished, finished=True)
        keep = exists & ~finished
        if self.config.lean_memory:
            # Keep the most likely output beam (lowest perplexity; paper §14.4): one KV row.
            best = out.score.masked_fill(~exists, NEG_INF).argmax(dim=1)
            best_alive = keep.gather(1, best[:, None])[:, 0]
            order = torch.arange(width)[None, :].expand(batch, width)
            order = torch.where(order == 0, best[:, None], order)
            keep = torch.zeros_like(keep)
            keep[:, 0] = best_alive
            # Within an iteration finished beams spend width as in full mode; the one kept beam
            # starts the next iteration with the full width again.
            remaining = torch.where(live, torch.where(best_alive, width, 0), remaining)
        else:
            order = keep.long().argsort(dim=1, descending=True, stable=True)
            keep = keep.gather(1, order)
            remaining = remaining - finished.sum(dim=1)
        seq = seq.gather(1, order[:, :, None].expand_as(seq))
        new_score = out.score.gather(1, order)
        path = path.gather(1, order[:, :, None].expand_as(path))
        origin = Origin(root=root.gather(1, order), path=path)
        untouched = ~live
        seq = torch.where(untouched[:, None, None], tokens, seq)
        new_score = torch.where(keep, new_score, 0.0)
        return seq, seq_len, new_score, keep, remaining, origin

    def _pool_add(
        self,
        pool: _Pool,
        seq: torch.Tensor,
        seq_len: torch.Tensor,
        prompt_len: torch.Tensor,
        score: torch.Tensor,
        mask: torch.Tensor,
        finished: bool,
    ) -> None:
        """Move the beams selected by `mask` [B, n] to the pool (generated tokens only)."""
        b, j = mask.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        # Independent of gamma (a controller may change it per iteration): no beam grows past
        # the budget, since an iteration's depth is capped at the budget left minus one.
        span = self.config.max_new_tokens + 1
        offset = (prompt_len[b][:, None] + torch.arange(span)).clamp(max=seq.shape[2] - 1)
        pool.session.append(b)
        pool.tokens.append(seq[b, j].gather(1, offset))
        pool.length.append(seq_len[b] - prompt_len[b])
        pool.score.append(score[b, j])
        pool.finished.append(torch.full_like(b, finished, dtype=torch.bool))

    def _results(
        self,
        batch: int,
        pool: _Pool,
        steps: torch.Tensor,
        counters: dict[str, torch.Tensor],
        history: list[dict[str, torch.Tensor]],
    ) -> list[DecodeResult]:
        penalty = self.config.length_penalty
        beams: list[list[Beam]] = [[] for _ in range(batch)]
        if pool.session:
            session = torch.cat(pool.session).tolist()
            tokens = torch.cat(pool.tokens).tolist()
            lengths = torch.cat(pool.length).tolist()
            scores = torch.cat(pool.score).tolist()
            finished = torch.cat(pool.finished).tolist()
            for b, tok, n, s, f in zip(session, tokens, lengths, scores, finished, strict=True):
                beams[b].append(Beam(tok[:n], s, f, s / max(n, 1) ** penalty))
        stats = [DecodeStats() for _ in range(batch)]
        target = counters["target"].tolist()
        draft = counters["draft"].tolist()
        drafted = counters["drafted"].tolist()
        accepted = counters["accepted"].tolist()
        emitted = steps.tolist()
        bias = counters["epsilon_bias"].tolist()
        for b in range(batch):
            st = stats[b]
            st.target_forward_passes, st.draft_forward_passes = target[b], draft[b]
            st.drafted_tokens, st.accepted_tokens = drafted[b], accepted[b]
            st.tokens_emitted = emitted[b]
            st.epsilon_bias_bound = bias[b]
        for record in history:
            live = record["live"].nonzero(as_tuple=True)[0].tolist()
            layers = record["accepted_layers"].tolist()
            widths = record["widths"].tolist()
            alphas = record["alphas"].tolist()
            for b in live:
                st = stats[b]
                st.iterations += 1
                st.accepted_layers.append(layers[b])
                st.widths.append([w for w in widths[b] if w >= 0])
                st.layer_alphas.append([a for a in alphas[b] if a >= 0])
        results = []
        for b in range(batch):
            ranked = sorted(beams[b], key=lambda beam: (-beam.score, beam.token_ids))
            results.append(DecodeResult(beams=ranked, stats=stats[b]))
        return results

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise ValueError("prompts: at least one prompt is required")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt; at least one token is required")
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(
                    f"prompts[{i}]: token id {bad[0]} out of range; allowed 0..{self.vocab - 1}"
                )
