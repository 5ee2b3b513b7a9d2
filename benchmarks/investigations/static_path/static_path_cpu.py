"""The two decode paths side by side on this CPU: which one `auto` should pick here.

Loads a pair once and decodes held-out prompts with beam sampling and DSBD (fixed knobs, so both
paths run the same iterations) on the dynamic path (`TransformerScorer`) and the static path
(`StaticScorer`, eager: no CUDA graphs on a CPU), interleaved prompt by prompt, and reports
ms/token per method and path, their ratio with a bootstrap interval, whether the tokens agree,
and the engine's share of DSBD's time (the decode's wall time minus its model calls, over the
wall time). With `--compile-probe` it also times one bucket's step compiled by Inductor against
the eager step (and how long compiling took).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/investigations/static_path/static_path_cpu.py \\
        [--pair smollm2|qwen-coder]

Writes results/static_path_cpu_<pair>.json and .md beside this file. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsbd.prompts import prompt_set
from dsbd_core import SamplingConfig, generate
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.pair import load_pair
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.static_step import idle_inputs, static_attention_for, step_function
from dsbd_core.models.transformer_scorer import TransformerScorer

PAIRS = {"smollm2": ("smollm2", "smollm2-draft"), "qwen-coder": ("qwen-coder", "qwen-coder-draft")}
METHODS = {
    "beam-w3": ("beam", {"width": 3}),
    "dsbd-w3-g2-fixed": ("dsbd", {"width": 3, "gamma": 2, "threshold": None}),
}


class Clocked:
    """A scorer that adds up the wall time of its model calls (set_roots + forward)."""

    def __init__(self, inner: TransformerScorer) -> None:
        self.inner, self.seconds = inner, 0.0

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        start = time.perf_counter()
        self.inner.set_roots(roots)
        self.seconds += time.perf_counter() - start

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        start = time.perf_counter()
        out = self.inner.forward(layers)
        self.seconds += time.perf_counter() - start
        return out

    def release(self) -> None:
        self.inner.release()


def decode(method: str, fields: dict, scorers: tuple, ids: list[int], args: Any) -> dict:
    target, draft = Clocked(scorers[0]), Clocked(scorers[1])
    config = SamplingConfig(
        max_new_tokens=args.max_new_tokens, seed=args.seed, eos_token_ids=args.stop_ids, **fields
    )
    start = time.perf_counter()
    result = generate(method, target, ids, config, draft if method == "dsbd" else None)
    wall = time.perf_counter() - start
    tokens = result.stats.tokens_emitted
    return {
        "ms_per_token": 1000 * wall / max(tokens, 1),
        "tokens": tokens,
        "engine_share": 1 - (target.seconds + draft.seconds) / wall,
        "beams": [b.token_ids for b in result.beams],
    }


def ratio_interval(static: list[float], dynamic: list[float], seed: int = 0) -> dict:
    """Geometric mean of per-prompt static/dynamic time ratios, 95 % bootstrap interval."""
    logs = np.log(np.array(static) / np.array(dynamic))
    rng = np.random.default_rng(seed)
    boot = [rng.choice(logs, logs.size).mean() for _ in range(2000)]
    low, high = np.percentile(boot, [2.5, 97.5])
    return {
        "value": float(np.exp(logs.mean())),
        "low": float(np.exp(low)),
        "high": float(np.exp(high)),
        "n": int(logs.size),
    }


def compile_probe(model: torch.nn.Module, slots: int, repeats: int) -> dict:
    """One bucket's step (1 row x `slots`) eager vs Inductor-compiled: ms each, compile s."""
    pool = StaticScorer(model, rows=1, length=256)._pool
    assert pool is not None
    step = step_function(model, pool, "sdpa", torch.float32)
    inputs = idle_inputs(pool, 1, slots)
    args = (inputs.input_ids, inputs.position_ids, inputs.write, inputs.allowed)
    out: dict[str, float] = {}
    with torch.inference_mode(), static_attention_for(model):
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        start = time.perf_counter()
        compiled(*args)
        out["compile_s"] = time.perf_counter() - start
        for name, fn in (("eager", step), ("compiled", compiled)) * repeats:
            start = time.perf_counter()
            fn(*args)
            out.setdefault(f"{name}_ms", []).append(1000 * (time.perf_counter() - start))
    return {k: statistics.median(v) if isinstance(v, list) else v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-probe", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype, decode_path="dynamic")
    args.stop_ids = pair.stop_ids
    paths = {
        "dynamic": (TransformerScorer(pair.target.model), TransformerScorer(pair.draft.model)),
        "static": (StaticScorer(pair.target.model), StaticScorer(pair.draft.model)),
    }
    prompts = prompt_set("held-out")[: args.prompts]
    runs: dict[str, dict[str, list[dict]]] = {m: {p: [] for p in paths} for m in METHODS}
    for index, prompt in enumerate(prompts):
        ids = pair.encode(prompt.text, chat=prompt.chat)
        order = list(paths) if index % 2 == 0 else list(reversed(paths))  # interleaved
        for name, (method, fields) in METHODS.items():
            for path in order:
                runs[name][path].append(decode(method, fields, paths[path], ids, args))
        print(f"prompt {index + 1}/{len(prompts)}", flush=True)
    summary = {}
    for name in METHODS:
        dynamic, static = runs[name]["dynamic"], runs[name]["static"]
        same = sum(a["beams"] == b["beams"] for a, b in zip(dynamic, static, strict=True))
        summary[name] = {
            "dynamic_ms_per_token": statistics.mean(r["ms_per_token"] for r in dynamic),
            "static_ms_per_token": statistics.mean(r["ms_per_token"] for r in static),
            "static_over_dynamic_time": ratio_interval(
                [r["ms_per_token"] for r in static], [r["ms_per_token"] for r in dynamic]
            ),
            "same_tokens": same,
            "engine_share_dynamic": statistics.mean(r["engine_share"] for r in dynamic),
            "engine_share_static": statistics.mean(r["engine_share"] for r in static),
        }
    report = {
        "what": __doc__.splitlines()[0],
        "pair": args.pair,
        "models": pair.describe(),
        "dtype": pair.dtype_name,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "cpu": _cpu(),
        "torch": torch.__version__,
        "threads": 1,
        "load_average_start": load_start,
        "summary": summary,
        "compile_probe": compile_probe(pair.target.model, 4, 5) if args.compile_probe else None,
        "load_average_end": os.getloadavg(),
    }
    out = args.out or Path(__file__).parent / "results" / f"static_path_cpu_{args.pair}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(_table(report))
    print(_table(report))


def _cpu() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("Model name")), "")
    return name or platform.processor()


def _table(report: dict) -> str:
    rows = [
        f"# Decode paths on {report['cpu']} ({report['pair']}, {report['dtype']}, "
        f"{report['prompts']} prompts x {report['max_new_tokens']} tokens, 1 thread)",
        "",
        f"load average {report['load_average_start']} -> {report['load_average_end']}",
        "",
        "| method | dynamic ms/token | static ms/token | static / dynamic time [95 % CI] "
        "| same tokens | engine share dyn / static |",
        "|---|---:|---:|---|---:|---|",
    ]
    for name, s in report["summary"].items():
        r = s["static_over_dynamic_time"]
        rows.append(
            f"| {name} | {s['dynamic_ms_per_token']:.1f} | {s['static_ms_per_token']:.1f} "
            f"| {r['value']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | {s['same_tokens']}"
            f"/{r['n']} | {s['engine_share_dynamic']:.2f} / "
            f"{s['engine_share_static']:.2f} |"
        )
    probe = report.get("compile_probe")
    if probe:
        rows += [
            "",
            f"Inductor on one bucket (1 x 4 slots): compile {probe['compile_s']:.0f} s, "
            f"step {probe['compiled_ms']:.1f} ms compiled vs {probe['eager_ms']:.1f} ms "
            "eager",
        ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
