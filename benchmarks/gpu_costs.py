"""Per-iteration cost of DSBD's model calls at paper-like sizes, and the speedup it implies.

Issue 7 item 5. On the project's CPU a forest verify of W x gamma nodes costs nearly what the
target steps it replaces cost (a CPU forward is compute-bound), so no CPU run can say what DSBD
gives where it is meant to run. This script measures the three model calls of an iteration on
whatever device it is given, at the sizes of the paper's pairs (a 68M draft shaped like
JackFram/llama-68m, a 7B target shaped like Llama-2-7B, bf16), with random weights: a forward's
time depends on shapes, not on weight values.

What is timed is the engine's own path, not an approximation: `Engine`
(dsbd_core/algorithm/engine.py)
decodes a random prompt of the given context length with `TransformerScorer`s over the two
models, and a thin wrapper times every `ScoreCall` it makes (`set_roots` + `forward`, the KV
compaction included), with a device synchronisation on both sides:

(a) draft step: DSBD's gamma draft calls of an iteration, one per draft layer: the first
    feeds the W roots' new tokens (`set_roots` + `forward([])`), the others one layer of W
    draft nodes (`forward([layer])`);
(b) forest verification: the target's one call per DSBD iteration, which feeds the roots' last
    token and all W x gamma forest nodes under the tree mask;
(c) beam-sampling step: the target's one call per iteration of beam sampling at width W.

Iterations start after `--warmup` untimed ones (the first is the prefill), so every timed call
works on a KV cache of the given context length (growing by at most gamma + 1 tokens per
iteration). Figures are medians over `--repeats` iterations. The engine's host-side work per
iteration (sampling, verification, bookkeeping, on the CPU) is the iteration's wall time minus
its model calls, reported separately. With random weights the draft's forest shape and which
verification branches run are those of a random pair; model-call shapes are not (fixed width,
no EOS: always W roots, W nodes per draft layer).

Modelled speedup over beam sampling at the same W, for accepted lengths measured on the real
Qwen2.5-Coder pair (read from benchmarks/results/):

    speedup = E * t_beam / (T_draft + t_verify)

E = tokens per iteration = mean accepted layers + 1 (the fallback or bonus token), T_draft =
the gamma draft calls of an iteration (about gamma * t_draft_step), t_verify = the verify call,
t_beam = one beam-sampling step. The root's beam-sampling step needs no extra term: the verify
call feeds each root's last token, the work of a beam step, in the same forward. A second
figure adds the engine's host work on both sides. Every such figure is labelled "modelled":
it combines costs measured here with acceptance measured elsewhere, and is not a decode timed
on this device; directly measured GPU figures (a `dsbd bench --device cuda` run in
benchmarks/results/) are listed next to them when they exist.

    .venv/bin/python benchmarks/gpu_costs.py                       # GPU: paper sizes, bf16
    .venv/bin/python benchmarks/gpu_costs.py --size tiny --device cpu --dtype float32 \
        --out /tmp/gpu_costs_smoke.json                            # CPU smoke run, ~1 min
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.transformer_scorer import TransformerScorer
from dsbd_core.tools.bench.harness import DTYPES, git_info, machine_info, versions
from dsbd_core.tools.bench.methods import MethodNameError, parse_method
from dsbd_core.tools.theory.predictor import tokens_per_iteration

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FORMULA = "speedup = E * t_beam / (T_draft + t_verify)"
FORMULA_HOST = "speedup_with_host = E * (t_beam + h_beam) / (T_draft + t_verify + h_dsbd)"
MODELLED_NOTE = (
    "modelled: per-call costs measured here (random weights) combined with tokens per "
    "iteration E measured on the real Qwen2.5-Coder pair on CPU; not a decode timed here"
)

# Model shapes. "paper": JackFram/llama-68m (draft) and Llama-2-7B (target), the pair of the
# paper's LLaMA experiments; "tiny": a few-MB pair for CPU smoke runs and tests.
SIZES: dict[str, dict[str, dict]] = {
    "paper": {
        "draft": dict(
            vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
        ),
        "target": dict(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
        ),
    },
    "tiny": {
        "draft": dict(
            vocab_size=2048, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        "target": dict(
            vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
    },
}  # fmt: skip
DEFAULT_CONTEXTS = {"paper": (256, 1024), "tiny": (32, 128)}


# ----------------------------------------------------------------------------------- models
def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A random-weight Llama of `shape`, created on `device` in `dtype` directly.

    Allocating on the device (no CPU float32 copy first) keeps a 7B target at seconds instead
    of minutes and at its bf16 size; `sdpa` is one of the two attention implementations that
    honour TransformerScorer's tree mask.
    """
    config = LlamaConfig(**shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def describe_model(model: PreTrainedModel, shape: dict) -> dict:
    """The config that was built, and its size (what the timings are of)."""
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "architecture": "LlamaForCausalLM (random weights)",
        "config": shape,
        "parameters": parameters,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


# ----------------------------------------------------------------------------------- timing
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

    Why a wrapper and not `dsbd_core.tools.bench.measure.measured`: that context samples RSS on a
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


def timed_iterations(
    engine: Engine,
    target: TimedScorer,
    draft: TimedScorer | None,
    prompt: list[int],
    warmup: int,
    repeats: int,
) -> list[Iteration]:
    """Run the engine's own iteration loop (as `Engine.run`) and time `repeats` iterations."""
    timers = [t for t in (target, draft) if t is not None]
    state = engine.start([prompt])
    out: list[Iteration] = []
    try:
        for index in range(warmup + repeats):
            for timer in timers:
                timer.calls.clear()
            synchronize(target.device)
            start = time.perf_counter()
            if not engine.next_iteration(state):
                raise RuntimeError("token budget spent before the last timed iteration")
            engine.advance(state, engine.verify(state, engine.propose(state)))
            synchronize(target.device)
            seconds = time.perf_counter() - start
            if index >= warmup:
                drafts = list(draft.calls) if draft is not None else []
                out.append(_checked(Iteration(seconds, drafts, list(target.calls)), engine))
    finally:
        for timer in timers:
            timer.release()
    return out


def _checked(iteration: Iteration, engine: Engine) -> Iteration:
    """Refuse a timing of anything but the calls claimed: gamma draft calls, one target call."""
    gamma = engine.config.gamma if engine.draft is not None else 0
    if len(iteration.draft_calls) != gamma or len(iteration.target_calls) != 1:
        raise RuntimeError(
            f"expected {gamma} draft calls and 1 target call per iteration, got "
            f"{len(iteration.draft_calls)} and {len(iteration.target_calls)}"
        )
    return iteration


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
    verify_rows: int  # median rows of the verify forward (one per root tree)
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


def random_prompt(bench: Bench, context: int) -> list[int]:
    """`context` random token ids: the prefix whose KV cache every timed call attends to."""
    generator = torch.Generator().manual_seed(bench.seed + context)
    vocab = bench.target.config.vocab_size
    return torch.randint(0, vocab, (context,), generator=generator).tolist()


def sampling_config(bench: Bench, width: int, gamma: int) -> SamplingConfig:
    """Config of a timed run: no EOS and enough budget that every iteration drafts gamma."""
    iterations = bench.warmup + bench.repeats + 1
    return SamplingConfig(
        width=width, gamma=gamma, threshold=bench.threshold, w_min=1, seed=bench.seed,
        max_new_tokens=iterations * (gamma + 1) + 1, eos_token_ids=(),
    )  # fmt: skip


def time_beam(bench: Bench, context: int, width: int) -> BeamCost:
    """(c) beam sampling at width W: the engine with no draft, one target call per step."""
    target = TimedScorer(TransformerScorer(bench.target), bench.device)
    engine = Engine(target, sampling_config(bench, width, 1), None)
    runs = timed_iterations(engine, target, None, random_prompt(bench, context), bench.warmup,
                            bench.repeats)  # fmt: skip
    return BeamCost(
        context=context,
        width=width,
        beam_step_ms=ms([r.target_calls[0].seconds for r in runs]),
        host_ms=ms([r.host_seconds for r in runs]),
        iterations=len(runs),
        rows=median_int([r.target_calls[0].rows for r in runs]),
        tokens_per_row=median_int([r.target_calls[0].tokens_per_row for r in runs]),
    )


def time_dsbd(bench: Bench, context: int, width: int, gamma: int) -> DsbdCost:
    """(a) draft calls and (b) the forest verification of DSBD iterations at (W, gamma)."""
    target = TimedScorer(TransformerScorer(bench.target), bench.device)
    draft = TimedScorer(TransformerScorer(bench.draft), bench.device)
    engine = Engine(target, sampling_config(bench, width, gamma), draft)
    runs = timed_iterations(engine, target, draft, random_prompt(bench, context), bench.warmup,
                            bench.repeats)  # fmt: skip
    return DsbdCost(
        context=context,
        width=width,
        gamma=gamma,
        draft_root_ms=ms([r.draft_calls[0].seconds for r in runs]),
        draft_layer_ms=ms([c.seconds for r in runs for c in r.draft_calls[1:]]),
        draft_iteration_ms=ms([sum(c.seconds for c in r.draft_calls) for r in runs]),
        verify_ms=ms([r.target_calls[0].seconds for r in runs]),
        host_ms=ms([r.host_seconds for r in runs]),
        iterations=len(runs),
        verify_rows=median_int([r.target_calls[0].rows for r in runs]),
        verify_tokens_per_row=median_int([r.target_calls[0].tokens_per_row for r in runs]),
    )


def measure_costs(
    bench: Bench,
    contexts: Sequence[int],
    widths: Sequence[int],
    gammas: Sequence[int],
    progress: bool,
) -> tuple[list[BeamCost], list[DsbdCost]]:
    """Every (context, W) beam step and every (context, W, gamma) DSBD iteration, in order."""
    from tqdm.auto import tqdm

    beams: list[BeamCost] = []
    dsbd: list[DsbdCost] = []
    total = len(contexts) * len(widths) * (1 + len(gammas))
    with tqdm(total=total, disable=not progress, dynamic_ncols=True, unit="config") as bar:
        for context in contexts:
            for width in widths:
                bar.set_postfix_str(f"L={context} W={width} beam")
                beam = time_beam(bench, context, width)
                beams.append(beam)
                bar.update()
                for gamma in gammas:
                    bar.set_postfix_str(f"L={context} W={width} gamma={gamma}")
                    cost = time_dsbd(bench, context, width, gamma)
                    cost.verify_over_beam_step = cost.verify_ms / beam.beam_step_ms
                    dsbd.append(cost)
                    bar.update()
    return beams, dsbd


# ----------------------------------------------------------------------------------- acceptance
@dataclass
class AcceptanceSource:
    """Tokens per iteration E of one method, measured (or modelled from alpha) on a real pair."""

    label: str
    method: str
    width: int
    gamma: int
    tokens_per_iteration: float
    source: str
    how: str


def shown(path: Path) -> str:
    """A path as the report names it: relative to the repository when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _method_shape(name: str) -> tuple[int, int, bool] | None:
    """(W, gamma, lean) of an engine method name; None for other methods."""
    try:
        spec = parse_method(name, gamma=1)
    except MethodNameError:
        return None
    if spec.family not in ("sps", "dsbd") or spec.gamma is None:
        return None
    return spec.width, spec.gamma, spec.lean


def sps_alpha_sources(path: Path, gammas: Sequence[int]) -> list[AcceptanceSource]:
    """Plain SpS at every gamma from the pair's measured acceptance alpha (i.i.d. model)."""
    alpha = json.loads(path.read_text())["overall"]["acceptance"]
    return [
        AcceptanceSource(
            label=f"SpS, alpha = {alpha:.3f} (i.i.d. model)",
            method=f"sps-g{gamma}",
            width=1,
            gamma=gamma,
            tokens_per_iteration=tokens_per_iteration(alpha, gamma),
            source=shown(path),
            how="E = sum_{k=0..gamma} alpha^k, alpha = overall Σ min(p, q) of eval-acceptance",
        )
        for gamma in gammas
    ]


def bench_sources(path: Path) -> list[AcceptanceSource]:
    """Mean accepted length per method of a `dsbd bench` run (results.json: summary)."""
    summary = json.loads(path.read_text())["summary"]
    out = []
    for name, row in summary.items():
        shape = _method_shape(name)
        length = row.get("mean_accepted_length")
        if shape is None or length is None or row.get("source", "dsbd") != "dsbd":
            continue
        out.append(AcceptanceSource(
            label=f"dsbd bench ({path.parent.name})", method=name, width=shape[0],
            gamma=shape[1], tokens_per_iteration=length + 1.0,
            source=shown(path), how="E = mean accepted layers per iteration + 1",
        ))  # fmt: skip
    return out


def width_distinct_sources(path: Path) -> list[AcceptanceSource]:
    """Accepted layers per iteration with the current width rule (the "estimate" rows)."""
    methods = json.loads(path.read_text())["methods"]
    out = []
    for name, row in methods.items():
        shape = _method_shape(name)
        if shape is None or "estimate" not in row:
            continue
        length = row["estimate"]["accepted_layers_per_iteration"]
        out.append(AcceptanceSource(
            label=f"width estimate ({path.stem})", method=name, width=shape[0], gamma=shape[1],
            tokens_per_iteration=length + 1.0, source=shown(path),
            how="E = accepted layers per iteration + 1 (distinct-draft width estimate)",
        ))  # fmt: skip
    return out


def acceptance_sources(
    results: Path, gammas: Sequence[int]
) -> tuple[list[AcceptanceSource], list[str]]:
    """Every E measured on the real pair that the result files hold, and what was left out."""
    notes: list[str] = []
    sources: list[AcceptanceSource] = []
    readers = [
        (results / "qwen_pair_acceptance.json", lambda p: sps_alpha_sources(p, gammas)),
        (results / "bench_qwen-coder_full" / "results.json", bench_sources),
        (results / "width_distinct_qwen-coder.json", width_distinct_sources),
    ]
    for path, read in readers:
        if not path.exists():
            notes.append(f"{shown(path)}: missing, its acceptance is not modelled")
            continue
        sources.extend(read(path))
    kept = [s for s in sources if not _method_shape(s.method)[2]]
    if len(kept) < len(sources):
        notes.append(
            "lean-memory methods left out: they keep one root row between iterations, a shape "
            "this grid does not time"
        )
    return kept, notes


# ----------------------------------------------------------------------------------- modelled
def modelled_speedups(
    sources: Sequence[AcceptanceSource], beams: Sequence[BeamCost], dsbd: Sequence[DsbdCost]
) -> list[dict]:
    """FORMULA (and FORMULA_HOST) for every source at every timed context with its (W, gamma)."""
    beam_at = {(b.context, b.width): b for b in beams}
    out = []
    for cost in dsbd:
        beam = beam_at[(cost.context, cost.width)]
        for source in sources:
            if (source.width, source.gamma) != (cost.width, cost.gamma):
                continue
            e = source.tokens_per_iteration
            iteration = cost.draft_iteration_ms + cost.verify_ms
            out.append({
                "kind": "modelled",
                "label": source.label,
                "method": source.method,
                "width": cost.width,
                "gamma": cost.gamma,
                "context": cost.context,
                "tokens_per_iteration": e,
                "t_beam_ms": beam.beam_step_ms,
                "t_draft_ms": cost.draft_iteration_ms,
                "t_verify_ms": cost.verify_ms,
                "speedup": e * beam.beam_step_ms / iteration,
                "speedup_with_host": e * (beam.beam_step_ms + beam.host_ms)
                / (iteration + cost.host_ms),
                "source": source.source,
            })  # fmt: skip
    return out


def measured_gpu_figures(results: Path) -> list[dict]:
    """Time ratios of `dsbd bench` runs made on a GPU, to print next to the modelled ones."""
    out = []
    for path in sorted(results.glob("*/results.json")):
        data = json.loads(path.read_text())
        config = data.get("config", {})
        if not str(config.get("device", "")).startswith("cuda"):
            continue
        for name, row in data.get("summary", {}).items():
            ratio = (row.get("time_vs_reference") or {}).get("value")
            if ratio:
                out.append({
                    "kind": "measured", "run": shown(path), "method": name,
                    "width": row.get("width"), "speedup": 1.0 / ratio,
                    "device": config.get("device"), "dtype": config.get("dtype"),
                })  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- outputs
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    """The costs table, the modelled speedups and any measured GPU figure, as markdown."""
    s = report["settings"]
    lines = [
        f"# Per-iteration costs: {s['size']} pair on {report['machine'].get('gpu', s['device'])}",
        "",
        f"dtype {s['dtype']}, torch {report['versions']['torch']}, random weights; draft "
        f"{report['models']['draft']['parameters'] / 1e6:.1f}M, target "
        f"{report['models']['target']['parameters'] / 1e6:.1f}M parameters; median of "
        f"{s['repeats']} iterations after {s['warmup']} warm-up; width rule "
        f"{'fixed' if s['threshold'] is None else 't = ' + str(s['threshold'])}.",
        "",
        "## Measured cost per call (ms)",
        "",
        "| context | W | γ | draft root call | draft layer call | draft calls / iteration "
        "| verify (W·γ nodes) | verify input rows x tokens | beam step | verify / beam step "
        "| host / DSBD iteration | host / beam step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    beam_at = {(b["context"], b["width"]): b for b in report["costs"]["beam"]}
    for c in report["costs"]["dsbd"]:
        b = beam_at[(c["context"], c["width"])]
        lines.append(
            f"| {c['context']} | {c['width']} | {c['gamma']} | {_fmt(c['draft_root_ms'])} | "
            f"{_fmt(c['draft_layer_ms'])} | {_fmt(c['draft_iteration_ms'])} | "
            f"{_fmt(c['verify_ms'])} | {c['verify_rows']} x {c['verify_tokens_per_row']} | "
            f"{_fmt(b['beam_step_ms'])} | "
            f"{_fmt(c['verify_over_beam_step'])} | {_fmt(c['host_ms'])} | {_fmt(b['host_ms'])} |"
        )
    lines += [
        "",
        "## Modelled speedup over beam sampling at the same W (modelled, not measured)",
        "",
        f"`{FORMULA}`; `{FORMULA_HOST}`. E: tokens per iteration measured on the real "
        "Qwen2.5-Coder pair (CPU runs); T_draft: the γ draft calls; the verify call already "
        "feeds each root's last token (the beam step of the root). W = 1: over multinomial "
        f"sampling. {MODELLED_NOTE}.",
        "",
        "| E from | method | W | γ | context | E | T_draft ms | t_verify ms | t_beam ms "
        "| modelled speedup | modelled, incl. host |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in report["modelled"]:
        lines.append(
            f"| {m['label']} | {m['method']} | {m['width']} | {m['gamma']} | {m['context']} | "
            f"{m['tokens_per_iteration']:.2f} | {m['t_draft_ms']:.2f} | {m['t_verify_ms']:.2f} | "
            f"{m['t_beam_ms']:.2f} | {m['speedup']:.2f} (modelled) | "
            f"{m['speedup_with_host']:.2f} (modelled) |"
        )
    lines += ["", "## Directly measured GPU figures", ""]
    if report["measured_gpu"]:
        lines += ["| run | method | W | measured speedup over beam |", "|---|---|---:|---:|"]
        lines += [
            f"| {m['run']} | {m['method']} | {m['width']} | {m['speedup']:.2f} (measured) |"
            for m in report["measured_gpu"]
        ]
    else:
        lines.append(
            "None: no `dsbd bench --device cuda` run is in benchmarks/results/ (no GPU has been "
            "lent to a session that could make one)."
        )
    lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def default_out(device: torch.device, size: str) -> Path:
    """benchmarks/results/gpu_costs_<device>.json, the device named by its GPU when there is one."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    suffix = "" if size == "paper" else f"_{size}"
    return RESULTS / f"gpu_costs_{slug}{suffix}.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="paper" if cuda else "tiny",
        help="model shapes (default: paper on CUDA, tiny on CPU)",
    )
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bfloat16" if cuda else "float32"
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=None,
        help="prompt (KV cache) lengths; default 256 1024 (paper), 32 128 (tiny)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (>= 1: prefill)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed iterations per config (default 20 on CUDA, 5 on CPU)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="dynamic-width threshold of the timed DSBD runs (default: fixed "
        "width; the model calls' shapes do not depend on it, host work does)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="where the measured acceptance results are read from",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (markdown next to it); default benchmarks/results/gpu_costs_<device>.json",
    )
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure, model, write JSON + markdown; returns the report (tests call this)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    contexts = args.contexts or list(DEFAULT_CONTEXTS[args.size])
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    torch.manual_seed(args.seed)
    shapes = SIZES[args.size]
    draft = build_model(shapes["draft"], device, dtype)
    target = build_model(shapes["target"], device, dtype)
    bench = Bench(target, draft, device, max(args.warmup, 1), repeats, args.threshold, args.seed)
    beams, dsbd = measure_costs(bench, contexts, args.widths, args.gammas, not args.no_progress)
    sources, notes = acceptance_sources(args.results, args.gammas)
    modelled = modelled_speedups(sources, beams, dsbd)
    timed = {(c.width, c.gamma) for c in dsbd}
    notes += [f"{s.method} ({s.label}): W = {s.width}, γ = {s.gamma} not timed, not modelled"
              for s in sources if (s.width, s.gamma) not in timed]  # fmt: skip
    report = {
        "what": __doc__.splitlines()[0],
        "formula": FORMULA,
        "formula_with_host": FORMULA_HOST,
        "modelled_note": MODELLED_NOTE,
        "settings": {
            "size": args.size,
            "device": str(device),
            "dtype": args.dtype,
            "widths": args.widths,
            "gammas": args.gammas,
            "contexts": contexts,
            "warmup": bench.warmup,
            "repeats": repeats,
            "threshold": args.threshold,
            "threads": args.threads,
            "seed": args.seed,
            "draft_width": "W (W_S = W)",
        },  # fmt: skip
        "machine": machine_info(device),
        "versions": versions(),
        "git": git_info(),
        "models": {
            "draft": describe_model(draft, shapes["draft"]),
            "target": describe_model(target, shapes["target"]),
        },  # fmt: skip
        "costs": {"beam": [asdict(b) for b in beams], "dsbd": [asdict(c) for c in dsbd]},
        "acceptance_sources": [asdict(s) for s in sources],
        "modelled": modelled,
        "measured_gpu": measured_gpu_figures(args.results),
        "notes": notes
        + [
            "weights are random: call costs depend on shapes; the forest's parent structure and "
            "the verification branches taken are those of a random pair",
            "host work = iteration wall time minus its model calls (engine sampling, "
            "verification and bookkeeping on the CPU)",
            "E comes from the Qwen2.5-Coder 0.5B/1.5B pair (float32, CPU); with paper-size "
            "costs it models a pair as cost-lopsided as 68M/7B accepting like that pair, not "
            "the acceptance of JackFram/llama-68m for Llama-2-7B (not measured here)",
        ],
    }
    out = args.out or default_out(device, args.size)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
