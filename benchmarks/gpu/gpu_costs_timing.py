"""Timing of the engine's model calls for benchmarks/gpu/gpu_costs.py: a scorer wrapper that times
each `ScoreCall` with a device synchronisation on both sides, and the records it fills.

Kept apart from the engine runs (gpu_costs_engine.py) so those can follow the engine's API
without touching how a call is timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.decode_path import make_scorer
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall time covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Call:
    """One engine `ScoreCall`: its wall time and the model input it became."""

    seconds: float
    rows: int  # batch rows of the model forward (the session's alive roots)
    tokens_per_row: int  # padded query length: new root tokens + that row's tree nodes


class TimedScorer:
    """A ForestScorer that times each engine `ScoreCall` (set_roots + forward) of another.

    Why a wrapper and not `dsbd.bench.decode.measure.measured`: that context samples RSS on a
    thread every 10 ms, which competes for the GIL inside millisecond, launch-bound GPU calls;
    here only a synchronisation and a clock read sit around each call. A pre-hook on the model
    records the input shape of each call, so the report shows what was timed (a beam step must
    feed 1 token per row; more would mean the KV cache was rebuilt instead of compacted).
    """

    def __init__(self, inner: TransformerScorer, device: torch.device) -> None:
        self.inner = inner
        self.device = device
        self.calls: list[Call] = []  # every ScoreCall since the last clear
        self._start: float | None = None
        self._shape = (0, 0)
        self._hook = inner.model.register_forward_pre_hook(self._record_shape, with_kwargs=True)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()
        self.inner.set_roots(roots)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        if self._start is None:
            synchronize(self.device)
            self._start = time.perf_counter()
        self._shape = (0, 0)
        out = self.inner.forward(layers)
        synchronize(self.device)
        self.calls.append(Call(time.perf_counter() - self._start, *self._shape))
        self._start = None
        return out

    def release(self) -> None:
        self.inner.release()
        self._hook.remove()

    def _record_shape(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self._shape = (int(ids.shape[0]), int(ids.shape[1]))


@dataclass
class Iteration:
    """One timed engine iteration: its wall time and its model calls, in call order."""

    seconds: float
    draft_calls: list[Call]
    target_calls: list[Call]

    @property
    def host_seconds(self) -> float:
        """Engine work on the host: the iteration minus its model calls."""
        calls = self.draft_calls + self.target_calls
        return self.seconds - sum(c.seconds for c in calls)


def ms(values: Sequence[float]) -> float | None:
    """Median in milliseconds (None when nothing was timed, e.g. layer calls at gamma 1)."""
    return 1000.0 * statistics.median(values) if values else None


def median_int(values: Sequence[int]) -> int:
    """Median of a shape count, as an int (the lower middle value for an even count)."""
    return int(statistics.median_low(values))


@dataclass
class BeamCost:
    """Beam sampling at width W: one target step per iteration."""

    context: int
    width: int
    beam_step_ms: float
    host_ms: float
    iterations: int
    rows: int  # median model-forward rows of the step (W once the beams are up)
    tokens_per_row: int  # median tokens fed per row: 1 (the beam's last token)


@dataclass
class DsbdCost:
    """One DSBD iteration at (W, gamma): gamma draft calls, one verify call, host work."""

    context: int
    width: int
    gamma: int
    draft_root_ms: float  # first draft call: set_roots + the roots' new tokens
    draft_layer_ms: float | None  # median later draft call: one layer of W nodes
    draft_iteration_ms: float  # all gamma draft calls of an iteration (T_draft)
    verify_ms: float  # the target's forest call: roots' last tokens + W x gamma nodes
    host_ms: float
    iterations: int
    verify_rows: int  # median rows of the verify forward (one per root tree, 1 when packed)
    verify_tokens_per_row: int  # median padded query: root's last token + its tree's nodes
    verify_over_beam_step: float | None = None


@dataclass
class Bench:
    """Everything one measurement needs: the two models, where they run, the loop sizes."""

    target: PreTrainedModel
    draft: PreTrainedModel
    device: torch.device
    warmup: int
    repeats: int
    threshold: float | None
    seed: int
    decode_path: str = "dynamic"  # the scorers' path (dsbd_core/models/decode_path.py)
    # where the engine's state lives: "model" (beside the models, as `generate` puts it) or
    # "cpu" (the host, as a serving router's engine; the baseline of the engine-placement A/B)
    engine: str = "model"
    compile: str | None = None  # the static path's bucket mode (None: the device's default)
    scorers: dict = field(default_factory=dict)

    @property
    def engine_device(self) -> torch.device:
        return torch.device("cpu") if self.engine == "cpu" else self.device

    @property
    def verify_graph(self) -> bool:
        """The verify side after its forward as one compiled graph (`--engine graph`)."""
        return self.engine == "graph"

    def scorer(self, which: str) -> TransformerScorer:
        """The target's or the draft's scorer on the bench's path, one per model for the whole
        run (a static one keeps its pool and captured buckets across configs)."""
        if which not in self.scorers:
            model = self.target if which == "target" else self.draft
            self.scorers[which] = make_scorer(model, self.decode_path, compile=self.compile)
        return self.scorers[which]

    def capture(self, rows: int, length: int) -> dict:
        """On the static path, capture every bucket before timing; its status per model."""
        out = {}
        for which in ("target", "draft"):
            scorer = self.scorer(which)
            if isinstance(scorer, StaticScorer):
                out[which] = scorer.capture(rows=rows, length=length)
        return out
