"""The speed-only knobs of an iteration, and who chooses them.

Two kinds of knobs shape a decode. The beam width W, the width threshold t, w_min, temperature,
top-k/p and mode decide which distribution the output follows: they are the request's and never
change. The draft depth gamma and the draft width W_S only decide how fast it gets there:
fixed-width DSBD is exact for every depth and draft width (docs/ALGORITHM.md), so a controller
may choose them per iteration (gamma = 0: a plain beam-sampling step). The decode loop
(`loop.Decode`) asks its controller before every iteration and tells it every outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict, Field

from dsbd_core.algorithm.config import SamplingConfig

if TYPE_CHECKING:  # annotations only: the session registry imports this module without torch
    from dsbd_core.algorithm.sequences.state import DecodeState, Outcome


class Knobs(BaseModel):
    """The speed knobs of one iteration."""

    model_config = ConfigDict(frozen=True)

    gamma: int = Field(..., ge=0)
    draft_width: int = Field(..., ge=1)


class Controller(Protocol):
    """Chooses each iteration's knobs from what the decode has seen so far."""

    def knobs(self, state: DecodeState) -> Knobs:
        """The knobs of the iteration about to start."""
        ...

    def observe(self, state: DecodeState, outcome: Outcome, knobs: Knobs) -> None:
        """The outcome of the iteration that ran with `knobs` (state not yet advanced)."""
        ...


class FixedKnobs:
    """The request's own gamma and W_S every iteration (reproducible experiments, baselines)."""

    def __init__(self, config: SamplingConfig) -> None:
        self._knobs = Knobs(gamma=config.gamma, draft_width=config.effective_draft_width)

    def knobs(self, state: DecodeState) -> Knobs:
        return self._knobs

    def observe(self, state: DecodeState, outcome: Outcome, knobs: Knobs) -> None:
        """Nothing to learn."""
