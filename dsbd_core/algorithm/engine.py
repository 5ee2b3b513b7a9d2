"""The decoding engine: beam sampling and DSBD as steps over a batch of independent sessions.

One engine runs every decoder of the project (multinomial sampling = beam sampling with W = 1;
SpS = DSBD with W = W_S = 1 and fixed width), so a statement such as "DSBD follows beam
sampling" compares two configurations of the same state machine, and the exactness tests can run
1e5 sessions in one batched call on an exact n-gram table.

Per iteration (ALGORITHM.md §2): the draft runs beam sampling of width W_S for gamma layers from the
input beams (`draft_forest.py`); the target scores the whole forest in one forward and the
layers are verified in order with a fixed or dynamic width (`verify_forest.py`); beams ending in
an EOS token move to the finished pool and take their slot with them (the remaining width R
shrinks), in beam sampling and in DSBD alike.

Scores are true cumulative target log-likelihoods of the generated tokens; the candidate table
of a step is exp((score + log p) / T) jointly filtered, i.e. beam sampling from the tempered
sequence distribution (ALGORITHM.md §11.3, §11.7).

The engine holds no model: its two sides are generators of `ScoreCall`s, answered by whoever
holds the model (`scorer.drive` in-process, a `SessionBatcher` batching many requests in a
replica). `loop.py` is the one loop that runs the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from dsbd_core.algorithm.draws.host_reads import may_read, one_copy, unpacked
from dsbd_core.algorithm.draws.streams import DRAFT_SIDE, VERIFY_SIDE, Streams
from dsbd_core.algorithm.iteration.beams import finds_rows, pool_add
from dsbd_core.algorithm.iteration.draft_forest import draft_forest, draft_layer
from dsbd_core.algorithm.iteration.side_graphs import (
    GraphScorer,
    draft_side,
    graph_applies,
    graph_for,
    run_fused,
    verify_side,
)
from dsbd_core.algorithm.iteration.verify_forest import verify_forest, verify_scored
from dsbd_core.algorithm.methods import MethodConfig
from dsbd_core.algorithm.scorer import (
    ForestLogprobs,
    ForestScorer,
    Origin,
    Roots,
    ScoreCall,
    drive,
    returning,
)
from dsbd_core.algorithm.sequences.logprobs import TokenLogprobs, splice
from dsbd_core.algorithm.sequences.result import DecodeResult, collect_results
from dsbd_core.algorithm.sequences.state import (
    NO_FOREST,
    DecodeState,
    Forest,
    Outcome,
    Plan,
    Pool,
    plan_iteration,
    planning_parts,
    zero_counters,
)
from dsbd_core.algorithm.sequences.stops import StopStrings

# The random streams of an iteration's two sides (`streams.py`).
DRAFT_STREAM, VERIFY_STREAM = DRAFT_SIDE, VERIFY_SIDE


class Engine:
    """The steps of decoding a batch of prompts with one configuration.

    A method without a draft (`config.uses_draft` False) runs target beam sampling (gamma =
    0); one with a draft, DSBD. The config is used as given: `methods.method_config` maps a
    method name and the user's `SamplingConfig` to the `MethodConfig` it runs with. The steps:
    `start`, then while `next_iteration`: `propose_steps` (draft side) ->
    `verify_steps` (target side) -> `advance`; `finish` builds the results. `loop.Decode` runs
    them; the engine itself never touches a model.
    """

    def __init__(
        self,
        config: MethodConfig,
        vocab_size: int,
        *,
        graph: bool = False,
        stop: StopStrings | None = None,
    ) -> None:
        self.config = config
        # stop strings: a beam also finishes where its text first holds one (stops.py)
        self.stop = stop
        self.vocab = vocab_size
        self.uses_draft = config.uses_draft
        # run each side's engine work between model calls as one compiled graph where it can
        # be (`side_graphs.py`: a device, no log-probs, no stop strings; either engine)
        self.graph = graph
        self.eos = torch.tensor(sorted(set(config.eos_token_ids)), dtype=torch.long, device="cpu")

    def start(self, prompts: list[list[int]], device: torch.device | str = "cpu") -> DecodeState:
        """The state before the first iteration: one input beam per session, the prompt.

        `device`: where the state and every tensor of the iteration live. On a GPU the state
        lives beside the models, so that the vocabulary-wide work of an iteration (candidate
        tables, draws, verification) runs there as device ops on the log-probs the forwards
        leave there, instead of copying them to the host (three rows of a 150k vocabulary
        are 1.8 MB a call) and running topk and the noise on the host's CPU.
        """
        self._check_prompts(prompts)
        device = torch.device(device)
        cfg = self.config
        batch, width = len(prompts), cfg.width
        gamma = cfg.draft_depth
        longest = max(len(p) for p in prompts)
        capacity = longest + cfg.max_new_tokens + gamma + 2
        prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        padded = [p + [0] * (longest - len(p)) for p in prompts]
        tokens = torch.zeros(batch, width, capacity, dtype=torch.long, device=device)
        tokens[:, :, :longest] = torch.tensor(padded, dtype=torch.long, device=device)[:, None, :]
        alive = torch.zeros(batch, width, dtype=torch.bool, device=device)
        alive[:, 0] = True  # one input beam at the start, no replicated rows (ALGORITHM.md §11.6)
        logprobs = None
        if cfg.logprobs is not None:  # one more position than any beam reaches (`splice`)
            top = min(cfg.logprobs, self.vocab)
            logprobs = TokenLogprobs.zeros((batch, width), cfg.max_new_tokens + 1, top, device)
        return DecodeState(
            tokens=tokens,
            length=prompt_len.clone(),
            prompt_len=prompt_len,
            score=torch.zeros(batch, width, dtype=torch.float64, device=device),
            alive=alive,
            remaining=torch.full((batch,), width, dtype=torch.long, device=device),
            steps=torch.zeros(batch, dtype=torch.long, device=device),
            origin=None,
            pool=Pool(),
            counters=zero_counters(batch, device),
            seed=cfg.seed if cfg.seed is not None else _fresh_seed(),
            logprobs=logprobs,
        )

    def next_iteration(self, state: DecodeState, gamma: int | None = None) -> bool:
        """Retire beams whose budget is spent and plan the next iteration's depth per session.

        `gamma` overrides the config's draft depth for this iteration only (0 = no draft, a plain
        beam-sampling step; any depth keeps fixed-width DSBD exact), which is how a controller
        adapts speculation per iteration. Returns False when nothing is left to decode.
        """
        gamma = self.gamma(gamma)
        ahead, state.plan = state.plan, None
        if ahead is None or ahead.gamma != gamma:  # else planned inside the last verify graph
            ahead = plan_iteration(
                state.length,
                state.prompt_len,
                state.remaining,
                state.alive,
                self.config.max_new_tokens,
                gamma,
            )
        live, retired, depth, flags = ahead.live, ahead.retired, ahead.depth, ahead.flags
        state.host_roots = None
        if may_read(flags):
            any_retired, any_live, deepest = (int(x) for x in flags.tolist())
        else:  # the roots the scorers plan from cross in the same copy (`Roots.host`)
            any_retired, any_live, deepest, state.host_roots = _planning_copy(state, ahead)
        if any_retired:
            compact = finds_rows(retired, state.logprobs is not None)
            pool_add(
                state.pool,
                state.tokens,
                state.length,
                state.prompt_len,
                state.score,
                retired,
                False,
                self.config.max_new_tokens,
                compact=compact,
            )
            if state.logprobs is not None:
                state.pool.logprobs.append(state.logprobs.rows(*retired.nonzero(as_tuple=True)))
            state.alive = state.alive & live[:, None]
        state.live = live
        state.depth, state.planned = depth, (depth, deepest)
        return bool(any_live)

    def gamma(self, gamma: int | None = None) -> int:
        """The draft depth an iteration plans with: 0 without a draft, else `gamma` or the
        config's."""
        if not self.uses_draft:
            return 0
        return self.config.gamma if gamma is None else gamma

    def propose_steps(
        self, state: DecodeState, streams: Streams | None = None, *, fused: bool = False
    ) -> Generator[ScoreCall, ForestLogprobs, Forest]:
        """Draft side: beam-sample the forest from the current input beams (ALGORITHM.md §3), as a
        generator of draft-model calls (one per draft layer). `streams`: the side's (default
        the state's iteration's); `fused`: it runs inside a side's graph
        (`side_graphs.draft_side`), so no part of it is a graph of its own."""
        assert state.depth is not None, "call next_iteration first"
        if not self.uses_draft:
            return returning(NO_FOREST)
        eos = self._place(state)
        streams = streams or self.streams(state, DRAFT_STREAM)
        layer_fn = None
        if not fused and self._graphed(state):
            layer_fn = graph_for(state.alive.device, draft_layer)
        # the side's generator itself, not one delegating to it: Dynamo traces no `yield from`
        return draft_forest(
            state, self.config, self.vocab, eos, streams, stop=self.stop, layer_fn=layer_fn
        )

    def verify_steps(
        self,
        state: DecodeState,
        forest: Forest,
        streams: Streams | None = None,
        *,
        fused: bool = False,
        then: Callable[[Outcome], Outcome] | None = None,
    ) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
        """Target side: one forward over the forest, layer-by-layer verification
        (ALGORITHM.md §4), as a generator of its one target-model call (`streams`, `fused`: as
        `propose_steps`; `then`: applied to the outcome before the side returns it)."""
        assert state.depth is not None, "call next_iteration first"
        eos = self._place(state)
        streams = streams or self.streams(state, VERIFY_STREAM)
        verify: Callable[..., Outcome] = verify_scored
        if not fused and self._graphed(state):
            verify = graph_for(state.alive.device, verify_scored)
        if then is not None:
            verify = _followed(verify, then)
        return verify_forest(
            state, forest, self.config, self.vocab, eos, streams, verify, stop=self.stop
        )

    def propose(self, state: DecodeState, scorer: ForestScorer) -> Forest:
        """The draft side against a model in this process: as one graph, its forwards inside,
        where `_fuses` (the draft's gamma layers unrolled), else its calls one by one."""
        if not self._fuses(state, scorer):
            return drive(scorer, self.propose_steps(state))
        if not self.uses_draft:
            return NO_FOREST
        assert isinstance(scorer, GraphScorer)
        streams = self.streams(state, DRAFT_STREAM)
        forest = run_fused(scorer, state, draft_side, self, state, streams)
        return forest if forest is not None else drive(scorer, self.propose_steps(state))

    def verify(self, state: DecodeState, forest: Forest, scorer: ForestScorer) -> Outcome:
        """The target side against a model in this process: as one graph, the forest forward
        inside, where `_fuses`, else its call driven (each side's engine work then a graph of
        its own where `_graphed`)."""
        if not self._fuses(state, scorer):
            return drive(scorer, self.verify_steps(state, forest))
        assert isinstance(scorer, GraphScorer)
        streams = self.streams(state, VERIFY_STREAM)
        outcome = run_fused(scorer, state, verify_side, self, state, forest, streams, self.gamma())
        return outcome if outcome is not None else drive(scorer, self.verify_steps(state, forest))

    def advance(self, state: DecodeState, outcome: Outcome) -> None:
        """Take the verified outcome as the next iteration's input beams."""
        assert state.live is not None and state.depth is not None
        for name, increment in outcome.counters.items():
            state.counters[name] += increment
        state.pool.extend(outcome.finished)
        splice_logprobs(state, outcome)
        state.history.append({"live": state.live, **outcome.record})
        state.iteration += 1
        state.steps += outcome.emitted
        state.tokens, state.length, state.score = outcome.tokens, outcome.length, outcome.score
        state.alive, state.remaining, state.origin = (
            outcome.alive,
            outcome.remaining,
            outcome.origin,
        )
        state.plan = outcome.plan  # the next plan where the verify graph made it

    def finish(self, state: DecodeState) -> list[DecodeResult]:
        """Every session's beams best-first and its statistics."""
        return collect_results(
            state.tokens.shape[0],
            state.pool,
            state.steps,
            state.counters,
            state.history,
            self.config.length_penalty,
        )

    def _graphed(self, state: DecodeState) -> bool:
        """Whether this iteration's sides run as compiled graphs: asked for, where the state
        lives on a device, for a config whose sides read nothing (`side_graphs.graph_applies`;
        a stop string's check reads on the host)."""
        return (
            self.graph
            and self.stop is None
            and graph_applies(self.config)
            and not may_read(state.alive)
        )

    def _fuses(self, state: DecodeState, scorer: ForestScorer) -> bool:
        """Whether a side runs whole as one graph with its model: `_graphed`, a model whose
        forwards read nothing (`side_graphs.GraphScorer`), and past the first iteration (a
        prefill runs eagerly: its shape is the prompt's, as in every engine with graphs)."""
        return isinstance(scorer, GraphScorer) and state.origin is not None and self._graphed(state)

    def streams(self, state: DecodeState, side: int) -> Streams:
        """The random streams of `side` in the state's current iteration: a function of the
        seed, the iteration and the side only, so every device draws the same numbers."""
        return Streams.side(state.seed, state.iteration, side)

    def _place(self, state: DecodeState) -> torch.Tensor:
        """Move the EOS ids to the state's device (the draws happen where the tables live);
        returns the EOS ids there."""
        device = state.tokens.device
        if self.eos.device != device:
            self.eos = self.eos.to(device)
        return self.eos

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


def _planning_copy(state: DecodeState, ahead: Plan) -> tuple[int, int, int, Roots]:
    """The planning values and the iteration's roots (its beams once the retired ones left),
    on the host in one copy (of the record the verify graph packed, where it did)."""
    parts = planning_parts(state.tokens, state.length, state.origin, ahead)
    if ahead.record is not None:
        host = unpacked(ahead.record.to("cpu"), parts)
    else:
        host = one_copy(parts, torch.device("cpu"))
    host_flags, tokens, length, alive, *rest = host
    any_retired, any_live, deepest = (int(x) for x in host_flags.tolist())
    roots = Roots(tokens, length, alive, Origin(*rest) if rest else None)
    return any_retired, any_live, deepest, roots


def _followed(
    verify: Callable[..., Outcome], then: Callable[[Outcome], Outcome]
) -> Callable[..., Outcome]:
    """`verify`, its outcome passed through `then`."""

    def run(*args: Any, **kwargs: Any) -> Outcome:
        return then(verify(*args, **kwargs))

    return run


def _fresh_seed() -> int:
    """A seed for a decode that names none: drawn once, on the host, from torch's global
    generator (so `torch.manual_seed` makes unseeded decodes reproducible too)."""
    return int(torch.randint(0, 2**62, (), device="cpu").item())


def splice_logprobs(state: DecodeState, outcome: Outcome) -> None:
    """Router side: the log-probs of the outcome's pool entries and next beams, each its input
    row with what the iteration added (call before the state takes the outcome's beams)."""
    if state.logprobs is None or outcome.logprobs is None:
        return
    start = state.length - state.prompt_len
    for segment in outcome.logprobs.finished:
        state.pool.logprobs.append(splice(state.logprobs, start, segment))
    batch, width = state.alive.shape
    state.logprobs = splice(state.logprobs, start, outcome.logprobs.beams).reshape(batch, width)
