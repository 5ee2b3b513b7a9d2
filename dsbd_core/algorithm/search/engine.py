"""The deterministic beam-search engine, and the one place an engine is chosen from a config.

`SearchEngine` has the `Engine`'s steps and state (so the one decode loop, the lockstep batch
decoder and the serving router run it unchanged); only its two sides differ: the draft runs
`walk.draft_search`, the target `walk.verify_search`, and the session's W best
finished hypotheses (`DecodeState.finished_scores`) travel with the state. Without a draft
(method `beam_search`) every iteration is one plain search step; with one
(`spec_beam_search`) an iteration may take several, the output being the same tokens.

`engine_for` is what `loop.Decode` and `loop.IterationCall.engine` build: `Engine` for
sampling methods, `SearchEngine` when `config.searching` (deterministic beam search, or beam
sampling under transformers' law: the search's steps over a sampled candidate set).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from dsbd_core.algorithm.draws.streams import Streams
from dsbd_core.algorithm.engine import DRAFT_STREAM, VERIFY_STREAM, Engine
from dsbd_core.algorithm.methods import MethodConfig
from dsbd_core.algorithm.scorer import ForestLogprobs, ScoreCall, returning
from dsbd_core.algorithm.search.sampled import draft_sampled_search
from dsbd_core.algorithm.search.walk import draft_search, verify_search
from dsbd_core.algorithm.sequences.result import DecodeResult, collect_results
from dsbd_core.algorithm.sequences.state import NO_FOREST, DecodeState, Forest, Outcome
from dsbd_core.algorithm.sequences.stops import StopStrings


def engine_for(
    config: MethodConfig,
    vocab_size: int,
    *,
    graph: bool = False,
    stop: StopStrings | None = None,
) -> Engine:
    """The engine that runs `config`: beam search when `config.search`, else sampling
    (`graph`: each side's engine work as one compiled graph where it applies, `side_graphs.py`;
    `stop`: the decode's stop strings, `stops.py`)."""
    kind = SearchEngine if config.searching else Engine
    return kind(config, vocab_size, graph=graph, stop=stop)


class SearchEngine(Engine):
    """Deterministic beam search (plain, or speculative with a draft); see `search.py`."""

    def start(self, prompts: list[list[int]], device: torch.device | str = "cpu") -> DecodeState:
        """As `Engine.start`, with no finished hypothesis yet."""
        state = super().start(prompts, device)
        batch, width = state.alive.shape
        state.finished_scores = torch.full(
            (batch, width), float("-inf"), dtype=torch.float64, device=state.alive.device
        )
        return state

    def propose_steps(
        self, state: DecodeState, streams: Streams | None = None, *, fused: bool = False
    ) -> Generator[ScoreCall, ForestLogprobs, Forest]:
        """Draft side: the draft's own beam search for the planned depth (`streams`, `fused`:
        as `Engine.propose_steps`; no part of it is a graph of its own either way)."""
        assert state.depth is not None, "call next_iteration first"
        if not self.uses_draft:
            return returning(NO_FOREST)
        eos = self._place(state)
        if self.config.selection == "transformers":  # sampled: DSBD under transformers' law
            streams = streams or self.streams(state, DRAFT_STREAM)
            return draft_sampled_search(state, self.config, eos, streams)
        return draft_search(state, self.config, eos)

    def verify_steps(
        self,
        state: DecodeState,
        forest: Forest,
        streams: Streams | None = None,
        *,
        fused: bool = False,
        then: Callable[[Outcome], Outcome] | None = None,
    ) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
        """Target side: one forward over the forest, the target's search steps through it
        (`streams`, `fused`, `then`: as `Engine.verify_steps`)."""
        assert state.depth is not None, "call next_iteration first"
        eos = self._place(state)
        streams = streams or self.streams(state, VERIFY_STREAM)
        return verify_search(
            state, forest, self.config, self.vocab, eos, streams, stop=self.stop, then=then
        )

    def advance(self, state: DecodeState, outcome: Outcome) -> None:
        """As `Engine.advance`, and the finished hypotheses' scores."""
        super().advance(state, outcome)
        state.finished_scores = outcome.finished_scores

    def finish(self, state: DecodeState) -> list[DecodeResult]:
        """The W best finished hypotheses of every session, best first."""
        return collect_results(
            state.tokens.shape[0],
            state.pool,
            state.steps,
            state.counters,
            state.history,
            self.config.length_penalty,
            keep=self.config.width,
        )
