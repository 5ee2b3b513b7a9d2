"""Measure what a target/draft pair costs here, once: the cost model's calibration.

The cost model (`dsbd_core.algorithm.policy.cost_model`) needs three things of the machine it runs
on: a target forward's time by the tokens it feeds, a draft forward's, and the engine's own work per
vocabulary-wide table. They depend on the models, their dtype, the device, the thread count and
the CPU; they are measured once and kept in `<cache>/calibration/<key>.json`, so every process
on the same machine decodes with the same calibration and a seeded request gives the same
tokens every time. `--recalibrate` (`dsbd generate|bench|batch`) or `force=True` measures again.

Forward times are medians over a few repeats of a forward that feeds n new tokens after a
cached prefix of `CONTEXT` tokens, n in `TOKEN_POINTS`. The engine's work is timed on the real
decode loop with a scorer that answers instantly (`_InstantScorer`), so the forwards cost nothing
and what is left is sampling, filtering, verification and bookkeeping. With a draft and the
pass-rate prompts, two things are measured by decoding them: the pair's pass rate per drafted
layer, and the seconds of a whole iteration at each fixed depth (`iteration_timer`: what the sum
of the parts misses), each cached like the costs.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate_batch
from dsbd_core.algorithm.drivers.loop import Decode, run_decode
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.policy.control import FixedKnobs, Knobs
from dsbd_core.algorithm.policy.cost_model import Calibration, ForwardCosts, layer_passes
from dsbd_core.algorithm.policy.iteration_timer import summarise, timing_plan
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, ForestScorer, Roots
from dsbd_core.algorithm.sequences.state import DecodeState, Outcome
from dsbd_core.models.loading import LoadedModel
from dsbd_core.models.presets import cache_root
from dsbd_core.models.tokens import encode_prompt, has_chat_template, stop_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONTEXT = 256
ENGINE_WIDTH = 3
TOKEN_POINTS = (1, 4, 8, 16, 32, 48)
REPEATS = 3
_FORMAT = 1
# The pair's pass rates are measured on these (chat prompts through the chat template, code as
# raw text: a pair agrees more on code), PASS_RATE_TOKENS tokens each, at the default settings.
PASS_RATE_TEXTS = (
    ("chat", "What is the capital of France?"),
    ("chat", "Give me three tips for sleeping well."),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("code", "import json\n\n\ndef load_config(path):\n"),
)
PASS_RATE_TOKENS = 32
# Whole iterations are timed at each fixed depth on the same prompts, this many tokens each.
ITERATION_TOKENS = 16


def forward_costs(
    model: PreTrainedModel, points: Sequence[int] = TOKEN_POINTS, repeats: int = REPEATS
) -> ForwardCosts:
    """Median seconds of a forward feeding n tokens after a cached `CONTEXT`-token prefix."""
    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = (torch.arange(CONTEXT + max(points)) * 7919 % min(vocab, 1000))[None, :].to(device)
    seconds = []
    with torch.inference_mode():
        prefix = model(input_ids=ids[:, :CONTEXT], use_cache=True).past_key_values
        for n in points:
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                cache = copy.deepcopy(prefix)
                _synchronize(device)
                start = time.perf_counter()
                model(
                    input_ids=ids[:, CONTEXT : CONTEXT + n],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=n,
                )
                _synchronize(device)
                times.append(time.perf_counter() - start)
            seconds.append(sorted(times[1:])[len(times[1:]) // 2])
    return ForwardCosts(tokens=list(points), seconds=seconds)


class _InstantScorer:
    """A scorer that answers every call at once with fixed random log-probabilities (K-wide
    over `support` when given, like a restricted draft head)."""

    def __init__(self, vocab_size: int, support: torch.Tensor | None = None) -> None:
        self._vocab = vocab_size
        self._support = support
        width = support.numel() if support is not None else vocab_size
        generator = torch.Generator().manual_seed(0)
        self._row = (torch.randn(width, generator=generator) * 3).log_softmax(-1)
        self._roots: tuple[int, ...] = (0, 0)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def set_roots(self, roots: Roots) -> None:
        self._roots = tuple(roots.alive.shape)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        batch, rows = self._roots
        roots = self._row.expand(batch, rows, -1) if rows else None
        self._roots = (batch, 0)
        out = [self._row.expand(*x.token.shape, -1) for x in layers]
        return ForestLogprobs(roots, out, self._support)

    def release(self) -> None:
        """Nothing is held."""


def engine_costs(
    vocab_size: int,
    support: torch.Tensor | None = None,
    width: int = 3,
    gamma: int = 2,
    iterations: int = 6,
) -> tuple[float, float]:
    """(seconds of a beam step, seconds each drafted layer adds) of the engine's own work.

    Timed on the decode loop with instant models, at depth 0 (a beam step) and at `gamma`
    (fixed width, W_S = W), the draft answering over `support` like the real one."""

    def per_iteration(depth: int) -> float:
        config = SamplingConfig(
            width=width,
            gamma=max(depth, 1),
            threshold=None,
            seed=0,
            max_new_tokens=iterations * (depth + 1) + 1,
        )
        drafting = depth > 0
        config = method_config("dsbd" if drafting else "beam", config)
        decode = Decode(config, vocab_size, [[1, 2, 3]], controller=FixedKnobs(config))
        draft = _InstantScorer(vocab_size, support) if drafting else None
        start = time.perf_counter()
        result = run_decode(decode, _InstantScorer(vocab_size), draft)
        return (time.perf_counter() - start) / max(result[0].stats.iterations, 1)

    per_iteration(gamma)  # warm up
    step = min(per_iteration(0) for _ in range(2))
    deep = min(per_iteration(gamma) for _ in range(2))
    return step, max(deep - step, 0.0) / gamma


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


def _cache_path(name: str, parts: Mapping[str, object]) -> Path:
    key = calibration_key({"what": name, **parts, **machine()})
    folder = os.environ.get("DSBD_CALIBRATION_DIR") or str(cache_root() / "calibration")
    return Path(folder) / f"{name}-{key}.json"


def read_cached(name: str, parts: Mapping[str, object]) -> str | None:
    """The text stored for `parts` on this machine, if any (`store_cached`)."""
    path = _cache_path(name, parts)
    return path.read_text() if path.is_file() else None


def store_cached(name: str, parts: Mapping[str, object], text: str) -> None:
    """Store `text` for `parts` on this machine: atomically, so that concurrent processes
    read a whole file or none."""
    path = _cache_path(name, parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(text)
    partial.replace(path)


def _cached(name: str, parts: Mapping[str, object], measure: Callable[[], str], force: bool) -> str:
    """The text `measure()` produced for `parts` on this machine (measured once, then read)."""
    text = None if force else read_cached(name, parts)
    if text is None:
        text = measure()
        store_cached(name, parts, text)
    return text


def model_costs(
    model: PreTrainedModel,
    identity: Mapping[str, object],
    *,
    force: bool = False,
    path: str = "dynamic",
) -> ForwardCosts:
    """The forward costs of a model on its decode path (`decode_path`), measured once per
    machine (what a serving replica reports); the path is part of the cache key."""

    def measure() -> str:
        if path == "static":
            from dsbd_core.models.static_scorer import static_forward_costs

            seconds = static_forward_costs(model, TOKEN_POINTS, REPEATS, CONTEXT)
            return ForwardCosts(tokens=list(TOKEN_POINTS), seconds=seconds).model_dump_json()
        return forward_costs(model).model_dump_json()

    key = identity if path == "dynamic" else {**identity, "decode_path": path}
    return ForwardCosts.model_validate_json(_cached("forward", key, measure, force))


def pair_engine_costs(
    vocab_size: int, support_size: int | None, *, force: bool = False
) -> tuple[float, float]:
    """`engine_costs` for a vocabulary and a draft's support size, measured once per machine."""
    support = torch.arange(support_size) if support_size else None

    def measure() -> str:
        return json.dumps(engine_costs(vocab_size, support, width=ENGINE_WIDTH))

    parts = {"vocab": vocab_size, "support": support_size, "width": ENGINE_WIDTH}
    step, layer = json.loads(_cached("engine", parts, measure, force))
    return float(step), float(layer)


def assemble(
    target: ForwardCosts,
    draft: ForwardCosts | None,
    vocab_size: int,
    support_size: int | None,
    description: str = "",
    *,
    force: bool = False,
) -> Calibration:
    """A calibration from the two models' measured costs (the router builds it from what its
    replicas report) and the engine's, measured here."""
    step, layer = pair_engine_costs(vocab_size, support_size, force=force)
    return Calibration(
        target=target,
        draft=draft,
        engine_step_s=step,
        engine_layer_s=layer,
        engine_width=ENGINE_WIDTH,
        description=description,
    )


def calibrate(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    identity: dict[str, object],
    vocab_size: int,
    *,
    draft_support: torch.Tensor | None = None,
    force: bool = False,
    say: Callable[[str], None] = print,
    path: str = "dynamic",
    prompts: list[list[int]] | None = None,
    stop_ids: tuple[int, ...] = (),
) -> Calibration:
    """The pair's calibration on a decode path: from the cache, or measured now (seconds for
    the embedded pair, 2.5 minutes for the Qwen pair on a 2-core CPU); with `prompts`
    (PASS_RATE_TEXTS, encoded) the pair's pass rates too."""
    start = time.perf_counter()
    description = str(identity.get("description", ""))
    say(f"cost model calibration (measured once per machine, then cached): {description}")
    skip = ("target", "draft", "description", "decode_path")
    common = {k: v for k, v in identity.items() if k not in skip}
    target_costs = model_costs(
        target, {"model": identity.get("target"), **common}, force=force, path=path
    )
    draft_costs = None
    if draft is not None:
        draft_id = {"model": identity.get("draft"), **common}
        draft_costs = model_costs(draft, draft_id, force=force, path=path)
    support = draft_support.numel() if draft_support is not None else None
    calibration = assemble(target_costs, draft_costs, vocab_size, support, description, force=force)
    if draft is not None and prompts:
        rates, single = (
            pair_pass_rates(
                target, draft, identity, prompts, stop_ids, force=force, path=path, method=m
            )
            for m in ("dsbd", "sps")
        )
        update = {"pass_rates": rates, "single_pass_rates": single}
        calibration = calibration.model_copy(update=update)
        say(f"the pair's pass rates per drafted layer: {', '.join(f'{r:.2f}' for r in rates)}")
        say(f"... and with one drafted beam (SpS): {', '.join(f'{r:.2f}' for r in single)}")
        timed = pair_iteration_seconds(
            target, draft, identity, prompts, stop_ids, force=force, path=path
        )
        calibration = calibration.model_copy(update=iteration_fields(timed, stop_ids))
        say(f"seconds per iteration by depth and the draft's catch-up per step behind: {timed}")
    say(f"calibration ready in {time.perf_counter() - start:.1f} s")
    return calibration


class PassCounter:
    """The default knobs every iteration (a `Controller`), counting each depth's passes: what
    `measure_pass_rates` and a serving router (deployments/decode/state.py) measure with."""

    def __init__(self, config: SamplingConfig) -> None:
        self.fixed = FixedKnobs(config)
        self.counts = [[0.0, 0.0] for _ in range(config.gamma)]

    def knobs(self, state: DecodeState) -> Knobs:
        return self.fixed.knobs(state)

    def observe(self, state: DecodeState, outcome: Outcome, knobs: Knobs) -> None:
        for total, (passed, tried) in zip(
            self.counts, layer_passes(state, outcome, len(self.counts)) or [], strict=False
        ):
            total[0] += passed
            total[1] += tried

    def rates(self) -> list[float]:
        """Each depth's pass rate; depths never tried are left out (the deepest measured
        stands for them)."""
        return [passed / tried for passed, tried in self.counts if tried > 0]


def pass_rate_config(stop_ids: tuple[int, ...]) -> SamplingConfig:
    """The settings the pass rates are measured at: DSBD's defaults (W = 3, gamma = 3, fixed
    width), seed 0, PASS_RATE_TOKENS tokens."""
    return SamplingConfig(seed=0, max_new_tokens=PASS_RATE_TOKENS, eos_token_ids=stop_ids)


def pass_rate_inputs(loaded: LoadedModel) -> dict[str, Any]:
    """PASS_RATE_TEXTS in `loaded`'s tokens (the chat ones through its chat template where it
    has one) and its stop ids: what a pair's pass rates are measured on."""
    prompts = [
        encode_prompt(loaded, text, chat=kind == "chat" and has_chat_template(loaded))
        for kind, text in PASS_RATE_TEXTS
    ]
    return {"prompts": prompts, "stop_ids": list(stop_token_ids(loaded))}


def measure_pass_rates(
    target: ForestScorer,
    draft: ForestScorer,
    prompts: list[list[int]],
    stop_ids: tuple[int, ...],
    method: str = "dsbd",
) -> list[float]:
    """Each drafted layer depth's pass rate (given the one above passed) of `method` at the
    default settings (dsbd: W = 3, gamma = 3, fixed width; sps: W = W_S = 1; seed 0) over
    `prompts`, PASS_RATE_TOKENS tokens each; depths never tried are left out (the deepest
    measured stands for them)."""
    config = method_config(method, pass_rate_config(stop_ids))
    counter = PassCounter(config)
    generate_batch(method, target, prompts, config, draft, controller=counter)
    return counter.rates()


def pair_pass_rates(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    identity: Mapping[str, object],
    prompts: list[list[int]],
    stop_ids: tuple[int, ...],
    *,
    force: bool = False,
    path: str = "dynamic",
    method: str = "dsbd",
) -> list[float]:
    """`measure_pass_rates` for a pair, measured once per machine and cached like its costs
    (the rates depend on the draft's variant and dtype, which the identity holds)."""
    measured = _pair_measurement(
        "pass-rates" if method == "dsbd" else f"{method}-pass-rates",
        functools.partial(measure_pass_rates, method=method),
        PASS_RATE_TOKENS,
        target,
        draft,
        identity,
        prompts,
        stop_ids,
        force=force,
        path=path,
    )
    return [float(x) for x in measured]


def _pair_measurement(
    name: str,
    measure: Callable[[ForestScorer, ForestScorer, list[list[int]], tuple[int, ...]], Any],
    tokens: int,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    identity: Mapping[str, object],
    prompts: list[list[int]],
    stop_ids: tuple[int, ...],
    *,
    force: bool,
    path: str,
) -> Any:
    """What `measure` finds decoding `prompts` (`tokens` each) with the pair's scorers on its
    decode path: measured once per machine, then read from the cache (JSON)."""
    from dsbd_core.models.decode_path import make_scorer

    def run() -> str:
        scorers = make_scorer(target, path), make_scorer(draft, path)
        return json.dumps(measure(*scorers, prompts, stop_ids))

    parts = {**identity, "prompts": prompts, "tokens": tokens, "stop": stop_ids}
    return json.loads(_cached(name, parts, run, force))


def iteration_config(stop_ids: tuple[int, ...]) -> SamplingConfig:
    """The settings whole iterations are timed at: DSBD's defaults (W = 3, gamma = 3, fixed
    width), seed 0, ITERATION_TOKENS tokens."""
    return SamplingConfig(seed=0, max_new_tokens=ITERATION_TOKENS, eos_token_ids=stop_ids)


def iteration_fields(timed: dict[str, Any], stop_ids: tuple[int, ...]) -> dict[str, Any]:
    """The `Calibration` fields of whole iterations timed at `iteration_config`
    (`measure_iteration_seconds`'s answer)."""
    config = iteration_config(stop_ids)
    return {
        "iteration_s": timed.get("iteration_s") or None,
        "catch_up_s": timed.get("catch_up_s"),
        "iteration_width": config.width,
        "iteration_draft_width": config.effective_draft_width,
    }


def measure_iteration_seconds(
    target: ForestScorer, draft: ForestScorer, prompts: list[list[int]], stop_ids: tuple[int, ...]
) -> dict[str, Any]:
    """The median seconds of a whole DSBD iteration at each fixed depth 0..gamma and of the
    draft's catch-up per iteration behind, one session at a time over `prompts`
    (`iteration_timer`)."""
    config = iteration_config(stop_ids)
    plan = timing_plan(prompts, config)
    for prompt, timer in plan:
        generate_batch("dsbd", target, [prompt], config, draft, controller=timer)
    seconds, catch_up = summarise([timer for _, timer in plan], config.gamma)
    return {"iteration_s": seconds, "catch_up_s": catch_up}


def pair_iteration_seconds(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    identity: Mapping[str, object],
    prompts: list[list[int]],
    stop_ids: tuple[int, ...],
    *,
    force: bool = False,
    path: str = "dynamic",
) -> dict[str, Any]:
    """`measure_iteration_seconds` for a pair, measured once per machine and cached."""
    measured = _pair_measurement(
        "iteration-seconds",
        measure_iteration_seconds,
        ITERATION_TOKENS,
        target,
        draft,
        identity,
        prompts,
        stop_ids,
        force=force,
        path=path,
    )
    return dict(measured)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
