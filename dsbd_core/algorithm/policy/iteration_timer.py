"""Timing whole DSBD iterations at fixed draft depths: what the cost model's sum of parts misses.

The cost model prices an iteration of depth gamma as the sum of its forwards' calibrated costs
and the engine's work (`cost_model.CostController.iteration_seconds`). A real iteration also pays
what no single forward shows: the draft's and target's per-call work outside the timed forward
(building the forest's attention plan, gathering caches, compacting after verification), which
grows with the number of drafted layers. On an AMD EPYC with the Qwen pair a drafted layer cost
the measured decode 1.43x a beam step where the sum of parts said 1.22x, so the cost model
drafted where it did not pay. Timing real iterations at each fixed depth, once per machine and
pair, gives the ratios the sum of parts gets wrong; the cost model scales its prices by them.

A draft that sat out some iterations must first catch up on the tokens the beams grew by since
it last ran: a probe after k beam steps costs a drafted iteration plus k steps' worth of draft
work (on that CPU and pair, ~15 ms per step behind against a 120 ms beam step). That is timed
too, so the cost model can price a probe before it makes one.

An `IterationTimer` is a `Controller` that runs a schedule of depths and notes the time at every
`knobs` call: the decode loop calls it once before each iteration and once more before it stops,
so consecutive notes bracket one whole iteration (its forwards, the engine's work, the
bookkeeping). Figures are medians over many iterations: the first one also prefills the prompt.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.policy.control import Knobs
from dsbd_core.algorithm.sequences.state import DecodeState, Outcome


class IterationTimer:
    """A `Controller` that runs the depths of `schedule`, one per iteration (the last one
    repeating), and times each whole iteration."""

    def __init__(
        self, config: SamplingConfig, schedule: Sequence[int], *, counted: bool = True
    ) -> None:
        if not schedule or not all(0 <= g <= config.gamma for g in schedule):
            raise ValueError(f"schedule={list(schedule)}: depths must be in 0..{config.gamma}")
        self.schedule = list(schedule)
        self.counted = counted  # False: a warm-up, left out of `summarise`
        self._draft_width = config.effective_draft_width
        self._marks: list[float] = []

    def knobs(self, state: DecodeState) -> Knobs:
        gamma = self.schedule[min(len(self._marks), len(self.schedule) - 1)]
        self._marks.append(time.perf_counter())
        return Knobs(gamma=gamma, draft_width=self._draft_width)

    def observe(self, state: DecodeState, outcome: Outcome, knobs: Knobs) -> None:
        """Nothing to learn: the depths are set."""

    def records(self) -> list[tuple[int, float, int | None]]:
        """(depth, seconds, behind) of each iteration that ran to its end; behind: the
        iterations since the draft last ran (None: it had not run yet, the prompt is new to it)."""
        out: list[tuple[int, float, int | None]] = []
        behind: int | None = None
        for i, (a, b) in enumerate(zip(self._marks, self._marks[1:], strict=False)):
            gamma = self.schedule[min(i, len(self.schedule) - 1)]
            out.append((gamma, b - a, behind if gamma > 0 else None))
            behind = 0 if gamma > 0 else (None if behind is None else behind + 1)
        return out


# A probe's schedule: the draft runs once (and so has seen the prompt), falls this many
# iterations behind, then runs again: that iteration's time less a caught-up one's is the
# draft's catch-up.
CATCH_UP = 8


def timing_plan(
    prompts: Sequence[list[int]], config: SamplingConfig
) -> list[tuple[list[int], IterationTimer]]:
    """(prompt, timer) in the order to decode them, each decode with its timer as controller:
    one warm-up decode that is not counted (a process's first decode pays one-time costs: kernel
    choice, allocations), then on each prompt in turn every fixed depth 0..gamma and a probe, so
    that a drift of the machine's speed falls on all of them alike."""
    if not prompts:
        return []
    plan = [(list(prompts[0]), IterationTimer(config, [config.gamma], counted=False))]
    for prompt in prompts:
        schedules = [[gamma] for gamma in range(config.gamma + 1)]
        schedules.append([1] + [0] * CATCH_UP + [1, 0])
        plan += [(list(prompt), IterationTimer(config, schedule)) for schedule in schedules]
    return plan


def summarise(timers: Sequence[IterationTimer], max_gamma: int) -> tuple[list[float], float | None]:
    """(the median seconds of an iteration at each depth 0..max_gamma with the draft caught
    up, the median seconds a drafted iteration adds per iteration the draft is behind);
    ([], None) when some depth has no iteration (nothing to compare it with). Timers not
    `counted` (warm-ups) are left out."""
    rows = [r for t in timers if t.counted for r in t.records()]
    medians = []
    for gamma in range(max_gamma + 1):
        seconds = [s for g, s, behind in rows if g == gamma and behind in (None, 0)]
        if gamma > 0:  # the draft's first run prefills the prompt: not a caught-up iteration
            seconds = [s for g, s, behind in rows if g == gamma and behind == 0] or seconds
        if not seconds:
            return [], None
        medians.append(statistics.median(seconds))
    catch_up = [max(s - medians[g], 0.0) / behind for g, s, behind in rows if g > 0 and behind]
    return medians, statistics.median(catch_up) if catch_up else None
