"""What an iteration costs on a device with its sides fused into graphs (issue 46).

    python3 benchmarks/gpu/gpu_engine.py [--device cuda] [--vocab 151936] [--out engine.json]
    python3 benchmarks/gpu/gpu_engine.py --size qwen [--out engine_qwen.json]

`--size tables` (default): the scorers are order-1 exact tables (`TableScorer`, the target's
random distribution and a sharper copy for the draft, no end of sequence): a forward is one
gather, so an iteration's time is the engine's own, at a real vocabulary. `--size qwen` /
`paper` / `tiny`: random-weight models of those shapes (benchmarks/gpu/gpu_costs_models.py) behind
`StaticScorer`, a 256-token prompt: with `graph=True` their forwards run inside the sides'
graphs (`models/static_side.py`), so the fused figure is a whole DSBD iteration of real model
shapes in two graph calls. Each method decodes one prompt to `--tokens` new tokens
with the engine's state on the device, its sides either eager (`graph=False`: one launch per
operation) or fused (`graph=True`: past the prefill a whole side, its model inside, is one
compiled graph; on CUDA one CUDA graph replay), the two interleaved round by round. Per
steady-state iteration (the prefill and the first iterations, which compile, left out):

* `ms`: wall time of one iteration (median; the loop's host work, the graphs, the one read);
* `graph_launches`, `kernel_launches`, `copies`: `cudaGraphLaunch`, kernel launch and memcpy
  calls counted by `torch.profiler` over a decode, per iteration (CUDA only);
* `waits`: operations that waited for the device, counted with
  `torch.cuda.set_sync_debug_mode("warn")` (CUDA only), and the lines that waited.

On a CPU (`--device cpu`) it is a smoke run: the device's branches are forced
(`computing_everywhere`) and the graphs run eagerly.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dsbd_core import SamplingConfig, TableScorer
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.drivers.loop import Decode, Propose
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.scorer import ForestScorer
from dsbd_core.models.static_scorer import StaticScorer

METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("dsbd-w3-g3-fixed", "dsbd", {"width": 3, "gamma": 3, "threshold": None}),
    ("dsbd-w3-g3-t0.7", "dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
    ("beam-w3", "beam", {"width": 3}),
    ("sps-g3", "sps", {"gamma": 3}),
    ("spec_beam_search-w3-g3", "spec_beam_search", {"width": 3, "gamma": 3}),
]
SKIPPED = 3  # the prefill and the iterations that compile a graph


class Pair:
    """The two scorers every decode of a run shares (a server's replica keeps its models and
    their pools), the vocabulary and the prompt."""

    def __init__(self, size: str, vocab: int, device: str) -> None:
        self.prompt = [1, 2, 3, 4]
        self.eos: tuple[int, ...] = (vocab - 1,)
        if size == "tables":
            self.target, self.draft = tables(vocab, device)
            self.vocab = vocab
            return
        try:  # benchmarks/gpu/ is on sys.path when this file runs as a script
            from gpu_costs_models import SIZES, build_model
        except ModuleNotFoundError:
            from benchmarks.gpu.gpu_costs_models import SIZES, build_model
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        models = [
            build_model(SIZES[size][k], torch.device(device), dtype) for k in ("target", "draft")
        ]
        self.target, self.draft = (StaticScorer(m) for m in models)
        self.vocab = self.target.vocab_size
        self.prompt = [(7919 * i) % min(self.vocab, 30000) + 1 for i in range(256)]
        self.eos = ()


def tables(vocab: int, device: str) -> tuple[TableScorer, TableScorer]:
    """Two order-1 tables, the draft's a sharper copy of the target's (so drafts are accepted
    often); the last token (the end of sequence) has no mass."""
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(vocab, generator=generator, dtype=torch.float64) * 3.0
    scorers = []
    for scale in (1.0, 1.3):
        logits = base * scale
        logits[-1] = -torch.inf
        scorers.append(TableScorer(torch.log_softmax(logits, -1), device=device))
    return scorers[0], scorers[1]


def decode(
    method: str, fields: dict[str, Any], pair: Pair, tokens: int, device: str, graph: bool
) -> tuple[list[float], int]:
    """One decode; the wall seconds of each iteration (from one Propose or lone Verify to the
    next) and how many iterations there were."""
    config = SamplingConfig(
        **{"max_new_tokens": tokens, "seed": 3, "eos_token_ids": pair.eos} | fields
    )
    target: ForestScorer = pair.target
    draft: ForestScorer = pair.draft
    vocab = pair.vocab
    run = Decode(method_config(method, config), vocab, [pair.prompt], device=device, graph=graph)
    steps, answer, starts = run.steps(), None, []
    drafting = run.config.uses_draft
    try:
        while True:
            call = steps.send(answer)
            if isinstance(call, Propose) or not drafting:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()  # only at an iteration's start: the loop's own read
                starts.append(time.perf_counter())
            if isinstance(call, Propose):
                answer = call.call.propose(draft, vocab)
            else:
                answer = call.call.verify(target, vocab, call.forest)
    except StopIteration:
        pass
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    starts.append(time.perf_counter())
    return [b - a for a, b in zip(starts, starts[1:], strict=False)], len(starts) - 1


def launches(method: str, fields: dict[str, Any], pair: Pair, tokens: int, graph: bool) -> dict:
    """Launch and copy calls per iteration over one decode (CUDA), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, iterations = decode(method, fields, pair, tokens, "cuda", graph)
    names = collections.Counter(e.name for e in prof.events())
    kernels = sum(n for name, n in names.items() if "LaunchKernel" in name)
    copies = sum(n for name, n in names.items() if name.startswith("cudaMemcpy"))
    return {
        "iterations": iterations,
        "graph_launches": names.get("cudaGraphLaunch", 0) / iterations,
        "kernel_launches": kernels / iterations,
        "copies": copies / iterations,
    }


def waits(method: str, fields: dict[str, Any], pair: Pair, tokens: int, graph: bool) -> dict:
    """Operations that waited for the device over one decode, per iteration, by line."""
    lines: collections.Counter = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, iterations = decode(method, fields, pair, tokens, "cuda", graph)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            lines[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return {"waits": sum(lines.values()) / iterations, "wait_lines": dict(lines.most_common(8))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=151_936, help="the tables' vocabulary")
    parser.add_argument("--size", default="tables", choices=("tables", "tiny", "qwen", "paper"))
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", nargs="*", help="names from METHODS (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    forced = nullcontext() if cuda else computing_everywhere()
    chosen = [m for m in METHODS if not args.methods or m[0] in args.methods]
    rows = []
    with forced:
        pair = Pair(args.size, args.vocab, device)
        for name, method, fields in chosen:
            row: dict[str, Any] = {"method": name}
            try:
                times: dict[bool, list[float]] = {False: [], True: []}
                decode(method, fields, pair, args.tokens, device, True)  # compiles
                for _ in range(args.rounds):  # eager and fused interleaved
                    for graph in (False, True):
                        seconds, iterations = decode(
                            method, fields, pair, args.tokens, device, graph
                        )
                        times[graph].extend(seconds[min(SKIPPED, len(seconds) - 1) :])
                        row["iterations"] = iterations
                for graph, label in ((False, "eager"), (True, "fused")):
                    row[f"{label}_ms"] = round(1e3 * statistics.median(times[graph]), 4)
                    if cuda:
                        counts = launches(method, fields, pair, args.tokens, graph)
                        counts |= waits(method, fields, pair, args.tokens, graph)
                        row[label] = counts
                row["fused_over_eager"] = round(row["fused_ms"] / row["eager_ms"], 4)
            except Exception as error:  # noqa: BLE001 (a method's failure is a finding, not the end)
                row["error"] = f"{type(error).__name__}: {error}"[:2000]
                row["trace"] = traceback.format_exc()[-3000:]
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            rows.append(row)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "size": args.size,
        "vocab": pair.vocab,
        "tokens": args.tokens,
        "note": f"per steady-state iteration (the first {SKIPPED} left out); "
        + (
            "order-1 table scorers: the engine's own cost"
            if args.size == "tables"
            else f"random-weight {args.size} shapes behind StaticScorer, a 256-token prompt"
        ),
        "methods": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
