"""The one decode loop: start -> (plan -> propose -> verify -> advance)* -> finish.

Written once, as a generator of the iteration's two side calls, and driven by whoever holds the
models: `run_decode` below answers both sides in-process (`generate`), `lockstep.py` batches the
sides of many decodes into shared forwards (`dsbd batch`), and the serving router sends them to
the draft and verifier deployments (`deployments/decode/session.py`). Each iteration:

1. the controller chooses the speed knobs (gamma, W_S; `control.py`) and the engine plans the
   depth (`Engine.next_iteration`); the loop ends when nothing is left to decode;
2. `Propose(call)`: the driver runs the draft side (`IterationCall.propose_steps`) and sends back
   the forest, or anything that stands for it (a serving driver sends an object-store handle
   it never opens); skipped when no layer is drafted;
3. `Verify(call, forest)`: the driver runs the target side and sends back the `Outcome`;
4. the controller sees the outcome and the engine advances the state.

A call carries everything its side needs (the state for the models and this iteration's
config), so the two sides may run in other processes; each draws from random streams seeded by
(seed, iteration, side), so every driver decodes the same tokens for the same seed.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.methods import MethodConfig
from dsbd_core.algorithm.policy.control import Controller, FixedKnobs, Knobs
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ForestScorer, ScoreCall, drive
from dsbd_core.algorithm.search.engine import engine_for
from dsbd_core.algorithm.sequences.penalties import processed_steps, processors_for
from dsbd_core.algorithm.sequences.result import DecodeResult
from dsbd_core.algorithm.sequences.state import (
    NO_FOREST,
    DecodeState,
    Forest,
    Outcome,
    deepest_layer,
)
from dsbd_core.algorithm.sequences.stops import StopStrings

R = TypeVar("R")


@dataclass
class IterationCall:
    """One iteration of one decode as its two sides see it (crosses processes when serving)."""

    state: DecodeState  # DecodeState.for_models(): tokens, scores, flags, depth, origin
    config: MethodConfig  # the decode's config with this iteration's knobs applied
    # Opaque to the algorithm: context a driver sends along with the call. The serving router
    # puts the W3C trace context of its iteration span here (`traceparent`, `tracestate`), so
    # the replicas' spans continue the request's trace (deployments/observability/tracing.py).
    trace: dict[str, str] = field(default_factory=dict)
    # A seeded decode's driver says which earlier iteration each side's cache continues and,
    # when a replica lost it, how to rebuild it bit for bit (dsbd_core/algorithm/drivers/replay.py).
    replay: Replay | None = None
    # each side's engine work between model calls as one compiled graph (`side_graphs.py`)
    graph: bool = False
    # the decode's stop strings (`stops.py`): both sides finish beams whose text holds one
    stop: StopStrings | None = None

    def engine(self, vocab_size: int) -> Engine:
        return engine_for(self.config, vocab_size, graph=self.graph, stop=self.stop)

    def propose_steps(self, vocab_size: int) -> Generator[ScoreCall, ForestLogprobs, Forest]:
        """The draft side as a generator of draft-model calls (answers processed by the
        decode's penalties, `penalties.py`: the draft proposes from the processed draft)."""
        steps = self.engine(vocab_size).propose_steps(self.state)
        return self._processed(steps, vocab_size)

    def verify_steps(
        self, vocab_size: int, forest: Forest
    ) -> Generator[ScoreCall, ForestLogprobs, Outcome]:
        """The target side as a generator of its one target-model call (its answer processed:
        the law kept is the processed target's)."""
        steps = self.engine(vocab_size).verify_steps(self.state, forest)
        return self._processed(steps, vocab_size)

    def propose(self, scorer: ForestScorer, vocab_size: int) -> Forest:
        """The draft side against a model in this process: one graph, the model inside, where
        the engine fuses it (`Engine.propose`: never with processors, which sit between the
        side and its model), else driven call by call."""
        if processors_for(self.config, vocab_size) is None:
            return self.engine(vocab_size).propose(self.state, scorer)
        return drive(scorer, self.propose_steps(vocab_size))

    def verify(self, scorer: ForestScorer, vocab_size: int, forest: Forest) -> Outcome:
        """The target side against a model in this process (as `propose`)."""
        if processors_for(self.config, vocab_size) is None:
            return self.engine(vocab_size).verify(self.state, forest, scorer)
        return drive(scorer, self.verify_steps(vocab_size, forest))

    def _processed(
        self, steps: Generator[ScoreCall, ForestLogprobs, R], vocab_size: int
    ) -> Generator[ScoreCall, ForestLogprobs, R]:
        procs = processors_for(self.config, vocab_size)
        if procs is None:
            return steps
        return processed_steps(steps, procs, self.state.prompt_len)


@dataclass
class PastIteration:
    """One finished iteration as the sides saw it (a seeded decode's history, replay.py)."""

    call: IterationCall  # no trace, no replay
    drafted: bool  # its draft side ran (a depth of 0 sends no draft call)
    layers: list[ForestLayer]  # the forest the target scored (parents, tokens; [] undrafted)


@dataclass
class Replay:
    """What a call of an exact (seeded) decode carries to rebuild lost caches (replay.py)."""

    last_drafted: int | None  # the latest earlier iteration whose draft side ran
    history: list[PastIteration] | None = None  # every earlier iteration, when asked for


@dataclass
class Propose:
    """Run the draft side of `call`; answer with its forest (or a handle standing for it)."""

    call: IterationCall


@dataclass
class Verify:
    """Run the target side of `call` on `forest` (the answer to `Propose`, or `NO_FOREST`);
    answer with the `Outcome`."""

    call: IterationCall
    forest: Any


SideCall = Propose | Verify


class Decode:
    """One decode call: a batch of prompts with one config, its state and its controller."""

    def __init__(
        self,
        config: MethodConfig,
        vocab_size: int,
        prompts: list[list[int]],
        *,
        controller: Controller | None = None,
        device: torch.device | str = "cpu",
        graph: bool = False,
        stop: StopStrings | None = None,
    ) -> None:
        self.config = config
        self.graph = graph  # each side's engine work as one compiled graph, where it applies
        # raises on a logit_bias key outside the vocabulary, before any step
        processors_for(config, vocab_size)
        if stop is not None and stop.min_tokens != config.min_tokens:
            stop = replace(stop, min_tokens=config.min_tokens)  # no stop before min_tokens
        self.stop = stop  # stop strings, sent with every call to both sides
        self.engine = engine_for(config, vocab_size, stop=stop)
        self.controller = controller or FixedKnobs(config)
        # raises on a bad prompt, before any step; `device`: where the state lives
        # (`engine_device`: beside an in-process model)
        self.state = self.engine.start(prompts, device)

    def steps(self) -> Generator[SideCall, Any, list[DecodeResult]]:
        """The loop; returns every session's result."""
        state = self.state
        while True:
            knobs = self.controller.knobs(state)
            if not self.engine.next_iteration(state, gamma=knobs.gamma):
                break
            assert state.depth is not None
            call = IterationCall(
                state.for_models(), self._config(knobs), graph=self.graph, stop=self.stop
            )
            drafting = self.config.uses_draft and deepest_layer(state) > 0
            forest = (yield Propose(call)) if drafting else NO_FOREST
            outcome = yield Verify(call, forest)
            self.controller.observe(state, outcome, knobs)
            self.engine.advance(state, outcome)
        return self.engine.finish(state)

    def _config(self, knobs: Knobs) -> MethodConfig:
        """The config with this iteration's knobs (the config itself when they are its own)."""
        config = self.config
        if knobs.gamma == config.gamma and knobs.draft_width == config.effective_draft_width:
            return config
        return config.model_copy(update={"gamma": knobs.gamma, "draft_width": knobs.draft_width})


def engine_device(scorer: ForestScorer) -> torch.device:
    """Where an in-process decode against `scorer` keeps its state: the scorer's
    `engine_device` where it has one (a transformers model: its device), else the host."""
    return torch.device(getattr(scorer, "engine_device", "cpu"))


def run_decode(
    decode: Decode, target: ForestScorer, draft: ForestScorer | None = None
) -> list[DecodeResult]:
    """Drive a decode to its end in this process: each side call against its scorer."""
    steps = decode.steps()
    vocab = target.vocab_size
    answer: Any = None
    try:
        while True:
            call = steps.send(answer)
            if isinstance(call, Propose):
                assert draft is not None, "a drafting decode needs a draft scorer"
                answer = call.call.propose(draft, vocab)
            else:
                answer = call.call.verify(target, vocab, call.forest)
    except StopIteration as stop:
        return stop.value
    finally:
        target.release()
        if draft is not None:
            draft.release()
