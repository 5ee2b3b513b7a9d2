"""Measure what a target/draft pair costs here, once: the cost model's calibration.

The cost model (`dsbd_core.algorithm.cost_model`) needs three things of the machine it runs on:
a target forward's time by the tokens it feeds, a draft forward's, and the engine's own work per
vocabulary-wide table. They depend on the models, their dtype, the device, the thread count and
the CPU; they are measured once and kept in `<cache>/calibration/<key>.json`, so every process
on the same machine decodes with the same calibration and a seeded request gives the same
tokens every time. `dsbd calibrate --force` (or `force=True`) measures again.

Forward times are medians over a few repeats of a forward that feeds n new tokens after a
cached prefix of `CONTEXT` tokens, n in `TOKEN_POINTS`. The engine's work is timed on the real
decode loop with a scorer that answers instantly (`_InstantScorer`), so the forwards cost nothing
and what is left is sampling, filtering, verification and bookkeeping.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.control import FixedKnobs
from dsbd_core.algorithm.cost_model import Calibration, ForwardCosts
from dsbd_core.algorithm.loop import Decode, run_decode
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.presets import cache_root

CONTEXT = 256
TOKEN_POINTS = (1, 4, 8, 16, 32, 48)
REPEATS = 3
_FORMAT = 1


def forward_costs(
    model: torch.nn.Module, points: Sequence[int] = TOKEN_POINTS, repeats: int = REPEATS
) -> ForwardCosts:
    """Median seconds of a forward feeding n tokens after a cached `CONTEXT`-token prefix."""
    device = next(model.parameters()).device
    ids = (torch.arange(CONTEXT + max(points)) * 7919 % 1000 + 10)[None, :].to(device)
    seconds = []
    with torch.inference_mode():
        prefix = model(input_ids=ids[:, :CONTEXT], use_cache=True).past_key_values
        for n in points:
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                cache = copy.deepcopy(prefix)
                _synchronize(device)
                start = time.perf_counter()
                model(input_ids=ids[:, CONTEXT : CONTEXT + n], past_key_values=cache,
                      use_cache=True, logits_to_keep=n)  # fmt: skip
                _synchronize(device)
                times.append(time.perf_counter() - start)
            seconds.append(sorted(times[1:])[len(times[1:]) // 2])
    return ForwardCosts(tokens=list(points), seconds=seconds)


class _InstantScorer:
    """A scorer that answers every call at once with fixed random log-probabilities."""

    def __init__(self, vocab_size: int, dtype: torch.dtype = torch.float32) -> None:
        self._vocab = vocab_size
        generator = torch.Generator().manual_seed(0)
        self._row = torch.randn(vocab_size, generator=generator, dtype=dtype).mul_(3)
        self._row = self._row.log_softmax(-1)
        self._roots = (0, 0)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def set_roots(self, roots: Roots) -> None:
        self._roots = tuple(roots.alive.shape)  # type: ignore[assignment]

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        batch, rows = self._roots
        roots = self._row.expand(batch, rows, -1) if rows else None
        self._roots = (batch, 0)
        return ForestLogprobs(roots, [self._row.expand(*x.token.shape, -1) for x in layers])

    def release(self) -> None:
        """Nothing is held."""


def engine_costs(
    vocab_size: int, width: int = 3, gamma: int = 2, iterations: int = 6
) -> tuple[float, float]:
    """(fixed seconds, seconds per layer candidate) of the engine's own work per iteration.

    Timed on the decode loop with instant scorers at depth 0 (a beam step: a W x V table) and
    at depth `gamma` (gamma draft layers and gamma + 1 verified tables of W x V each)."""

    def per_iteration(depth: int) -> float:
        config = SamplingConfig(width=width, gamma=max(depth, 1), threshold=None, seed=0,
                                max_new_tokens=iterations * (depth + 1) + 1)  # fmt: skip
        method_draft = depth > 0
        scorer = _InstantScorer(vocab_size)
        decode = Decode(config, vocab_size, [[1, 2, 3]], uses_draft=method_draft,
                        controller=FixedKnobs(config))  # fmt: skip
        start = time.perf_counter()
        result = run_decode(decode, scorer, _InstantScorer(vocab_size) if method_draft else None)
        return (time.perf_counter() - start) / max(result[0].stats.iterations, 1)

    per_iteration(gamma)  # warm up
    beam, deep = per_iteration(0), per_iteration(gamma)
    per_candidate = max(deep - beam, 0.0) / (gamma * vocab_size * 2 * width)
    fixed = max(beam - vocab_size * width * per_candidate, 0.0)
    return fixed, per_candidate


def calibration_key(parts: dict[str, object]) -> str:
    """A file name for what a calibration depends on."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(f"{_FORMAT}:{text}".encode()).hexdigest()[:20]


def machine() -> dict[str, object]:
    """What a calibration is only valid for: CPU model, torch, threads."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def calibrate(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    identity: dict[str, object],
    vocab_size: int,
    *,
    force: bool = False,
    say=print,  # noqa: ANN001 - where progress goes
) -> Calibration:
    """The pair's calibration: from the cache, or measured now (a few seconds to a minute)."""
    key = calibration_key({**identity, **machine()})
    path = Path(os.environ.get("DSBD_CALIBRATION_DIR", cache_root() / "calibration")) / (
        key + ".json"
    )
    if path.is_file() and not force:
        return Calibration.model_validate_json(path.read_text())
    say(f"calibrating the cost model ({identity.get('description', key)}) ...")
    start = time.perf_counter()
    target_costs = forward_costs(target)
    draft_costs = forward_costs(draft) if draft is not None else None
    fixed, per_candidate = engine_costs(vocab_size)
    calibration = Calibration(
        target=target_costs, draft=draft_costs, engine_fixed_s=fixed,
        engine_per_candidate_s=per_candidate, vocab_size=vocab_size,
        description=str(identity.get("description", "")),
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(calibration.model_dump_json(indent=1))
    partial.replace(path)
    say(f"calibrated in {time.perf_counter() - start:.0f} s: {path}")
    return calibration


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
