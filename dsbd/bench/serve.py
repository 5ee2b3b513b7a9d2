"""The served path (`dsbd serve`: router, draft, verifier on loopback Ray), per model pair.

`--pair smollm2` (the embedded SmolLM2 pair): the served path against the in-process engine,
two figures side by side in one run (this machine is shared and noisy, so every comparison
alternates its two sides and is reported as a ratio):

1. **Per-token latency overhead**: one request at a time, the same prompt, seed and config
   (`adaptive: false`, so both sides decode the very same tokens), decoded in-process by the
   engine and over HTTP by `dsbd serve`. Overhead = distributed / in-process - 1.
2. **Concurrency gain**: N requests sent all at once vs the same N one after the other, both over
   HTTP. Gain = concurrent throughput / sequential throughput (tokens per second).

With one torch thread per model replica and the in-process side on one thread too. Writes
benchmarks/results/serving_smollm2.json and a plot beside it.

`--pair qwen-coder` (the Qwen2.5-Coder 0.5B -> 1.5B pair; `dsbd models install qwen-coder`):
DSBD against beam sampling, both through the server, one request at a time, alternating which
goes first per prompt, then 4 DSBD requests at once vs one by one. Writes
benchmarks/results/serving_qwen.json.

`--overhead` (either pair): where the served path's extra time goes. One request at a time;
for each iteration the router's wall time minus the draft's and the verifier's batch compute
(from the native API's `stats.serving`) is what the Serve calls, the object store and the
router cost. Beam sampling makes one call per iteration, DSBD two (and moves the forest). Set
RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 in the environment to compare that Serve mode (it
measured worse here: serving_overhead_same_thread.json, in git history at 45aeca3). Writes
benchmarks/results/serving_overhead.json (serving_overhead_qwen.json for the Qwen pair).

    dsbd bench serve [--rounds 3] [--max-new-tokens 32]
    dsbd bench serve --pair qwen-coder [--max-new-tokens 64]
    dsbd bench serve --overhead [--rounds 3]

Each run starts `dsbd serve` itself (loopback only: dsbd/bench/served.py). Not timed tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsbd.bench.served import chat_ids, http_decode, start_server, stop_server, throughput
from dsbd.common import fail
from dsbd.prompts import EVERYDAY_PROMPTS as PROMPTS


@dataclass(frozen=True)
class ServedPair:
    """A pair as the server loads it, with what its run measures by default."""

    target: str
    draft: str
    prompts: tuple[str, ...]  # the requests (one user turn of the chat template each)
    max_new_tokens: int
    port: int
    out: str  # under benchmarks/results/
    overhead_out: str  # --overhead's


PAIRS = {
    "smollm2": ServedPair(
        "smollm2",
        "smollm2-draft",
        tuple(PROMPTS),
        32,
        8765,
        "serving_smollm2.json",
        "serving_overhead.json",
    ),
    "qwen-coder": ServedPair(
        "qwen-coder",
        "qwen-coder-draft",
        (
            "Write a Python function that checks whether a number is prime.",
            "Write a Python function that reverses the words of a sentence.",
            "Write a Python function that merges two sorted lists.",
            "Write a Python function that counts the vowels in a string.",
        ),
        64,
        8766,
        "serving_qwen.json",
        "serving_overhead_qwen.json",
    ),
}
OVERHEAD_TOKENS, OVERHEAD_PORT = 24, 8767  # --overhead's defaults, for either pair
RESULTS = "benchmarks/results"
# The SmolLM2 figures and the overhead: DSBD (threshold 0.7) and beam sampling at W = 3
CONFIGS = {
    "dsbd": {"method": "dsbd", "width": 3, "gamma": 2, "threshold": 0.7},
    "beam": {"method": "beam", "width": 3},
}
# The Qwen pair: DSBD at the server's default knobs (fixed width W = 3, the cost model choosing
# the depth up to gamma = 3 each iteration), with four draft beams per layer (W_S = 4, the
# fastest measured)
QWEN_CONFIGS = {
    "dsbd": {
        "method": "dsbd",
        "width": 3,
        "draft_width": 4,
        "gamma": 3,
        "threshold": None,
        "adaptive": True,
    },
    "beam": {"method": "beam", "width": 3},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dsbd bench serve` (None: the pair's or the mode's default)."""
    parser.add_argument("--pair", choices=list(PAIRS), default="smollm2", help="(default: smollm2)")
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="the router's wall time minus the replicas' compute, per iteration",
    )
    parser.add_argument(
        "--rounds", type=int, help="passes over the prompts (default: 3; qwen-coder: 1)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help="default: 32, qwen-coder 64, --overhead 24"
    )
    parser.add_argument(
        "--concurrency", type=int, help="requests at once, the first N prompts (default: all)"
    )
    parser.add_argument("--port", type=int, help="default: 8765, qwen-coder 8766, --overhead 8767")
    parser.add_argument("--batch-wait-s", type=float, default=0.01, help="the replicas' batching")
    parser.add_argument(
        "--out",
        help=f"JSON results (default: {RESULTS}/serving_smollm2.json, serving_qwen.json; "
        "--overhead: serving_overhead.json, serving_overhead_qwen.json)",
    )


def run(args: argparse.Namespace) -> int:
    """Run `dsbd bench serve`: fill in the pair's defaults, check them, run the measurement."""
    pair = PAIRS[args.pair]
    mode = "overhead" if args.overhead else args.pair
    defaults = {
        "rounds": 1 if mode == "qwen-coder" else 3,
        "concurrency": len(pair.prompts),
        "max_new_tokens": OVERHEAD_TOKENS if args.overhead else pair.max_new_tokens,
        "port": OVERHEAD_PORT if args.overhead else pair.port,
        "out": f"{RESULTS}/{pair.overhead_out if args.overhead else pair.out}",
    }
    for flag, value in defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    args.out = Path(args.out)
    if args.rounds < 1 or args.max_new_tokens < 1:
        return fail(f"--rounds={args.rounds} --max-new-tokens={args.max_new_tokens}: allowed >= 1")
    if not 1 <= args.concurrency <= len(pair.prompts):
        return fail(f"--concurrency={args.concurrency}: allowed 1..{len(pair.prompts)}")
    runner = {"smollm2": run_smollm2, "qwen-coder": run_qwen, "overhead": run_overhead}[mode]
    runner(args, pair)
    return 0


def save(path: Path, results: dict) -> None:
    """Write the results; the runs call it before they stop the server (a slow stop must not
    lose them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def measure_latency(
    args: argparse.Namespace,
    url: str,
    pair: tuple[Any, Any],
    prompts: list[list[int]],
    stops: tuple[int, ...],
    knobs: dict,
) -> dict:
    """Figure 1: per-token latency in-process vs over HTTP, one request at a time, alternating.

    `pair` is the (target, draft) LoadedModel loaded in this process; `adaptive: false` on the
    HTTP side makes both sides decode the very same tokens, which `same_tokens` checks.
    """
    from dsbd_core import SamplingConfig
    from dsbd_core.algorithm.drivers.decoders import generate
    from dsbd_core.models.transformer_scorer import TransformerScorer

    target, draft = pair
    method = knobs["method"]
    config_knobs = {k: v for k, v in knobs.items() if k != "method"}
    latency: dict[str, list[Any]] = {
        "in_process": [],
        "distributed": [],
        "server_side": [],
        "same_tokens": [],
    }
    for round_ in range(args.rounds):
        for i, ids in enumerate(prompts):
            seed = 1000 * round_ + i
            config = SamplingConfig(
                max_new_tokens=args.max_new_tokens, seed=seed, eos_token_ids=stops, **config_knobs
            )
            order = (0, 1) if (round_ + i) % 2 == 0 else (1, 0)
            for side in order:
                if side == 0:
                    start = time.perf_counter()
                    local = generate(
                        method,
                        TransformerScorer(target.model),
                        ids,
                        config,
                        TransformerScorer(draft.model),
                    )
                    local_s = time.perf_counter() - start
                else:
                    remote = http_decode(url, ids, knobs, args.max_new_tokens, seed)
            tokens = local.stats.tokens_emitted
            latency["in_process"].append(local_s / tokens)
            latency["distributed"].append(remote["client_seconds"] / tokens)
            latency["server_side"].append(remote["stats"]["serving"]["wall_seconds"] / tokens)
            latency["same_tokens"].append(
                [b["token_ids"] for b in remote["beams"]] == [b.token_ids for b in local.beams]
            )
    ratios = [d / p for d, p in zip(latency["distributed"], latency["in_process"], strict=True)]
    return {
        "per_token_s": {k: statistics.median(v) for k, v in latency.items() if k != "same_tokens"},
        "latency_ratio_median": statistics.median(ratios),
        "latency_ratio_mean": statistics.fmean(ratios),
        "same_tokens_fraction": sum(latency["same_tokens"]) / len(latency["same_tokens"]),
        "pairs": len(ratios),
    }


def measure_concurrency(
    args: argparse.Namespace, url: str, prompts: list[list[int]], knobs: dict
) -> dict:
    """Figure 2: the same N requests one by one vs all at once over HTTP, alternating which
    goes first per round (each round's ratio is its gain)."""
    seq, conc, batches = [], [], []
    for round_ in range(args.rounds):
        seeds = [5000 + 100 * round_ + i for i in range(len(prompts))]
        first = round_ % 2 == 1
        one, many, seen = throughput(url, prompts, knobs, args.max_new_tokens, seeds, first)
        seq.append(one)
        conc.append(many)
        batches += seen
    return {
        "throughput_tokens_per_s": {
            "sequential": statistics.median(seq),
            "concurrent": statistics.median(conc),
        },
        "concurrency_gain": statistics.median([c / s for c, s in zip(conc, seq, strict=True)]),
        "mean_verifier_batch_requests_concurrent": statistics.fmean(batches),
    }


def run_smollm2(args: argparse.Namespace, pair: ServedPair) -> None:
    """Both SmolLM2 figures per config, the models loaded here too; the results and a plot."""
    import torch

    from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids

    torch.set_num_threads(1)
    target, draft = load_causal_lm(pair.target), load_causal_lm(pair.draft)
    stops = stop_token_ids(target)
    prompts = [encode_prompt(target, p) for p in pair.prompts[: args.concurrency]]
    workdir = Path(tempfile.mkdtemp(prefix="dsbd-bench-"))
    process, info = start_server(workdir, args.port, args.batch_wait_s, pair.target, pair.draft)
    url = info["url"]
    results: dict = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "configs": CONFIGS,
        "batch_wait_s": args.batch_wait_s,
    }
    try:
        for name, knobs in CONFIGS.items():
            # warm both paths (first calls pay imports, allocator growth, caches)
            http_decode(url, prompts[0], knobs, 4, 0)
            entry = measure_latency(args, url, (target, draft), prompts, stops, knobs)
            entry.update(measure_concurrency(args, url, prompts, knobs))
            results[name] = entry
            print(name, json.dumps(entry, indent=1), flush=True)
        save(args.out, results)
        plot(results, args.out.with_suffix(".png"))
    finally:
        stop_server(process, info["pid"], wait_s=120)


def run_qwen(args: argparse.Namespace, pair: ServedPair) -> None:
    """DSBD against beam sampling through the server per prompt, then DSBD's concurrency."""
    prompts = list(pair.prompts[: args.concurrency])
    prompt_ids = chat_ids(pair.target, prompts)
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="dsbd-bench-qwen-"))
    process, info = start_server(workdir, args.port, args.batch_wait_s, pair.target, pair.draft)
    url, n = info["url"], args.max_new_tokens
    per_token: dict[str, list[float]] = {name: [] for name in QWEN_CONFIGS}
    stats: dict[str, list[dict]] = {name: [] for name in QWEN_CONFIGS}
    keep = ("tokens_emitted", "target_forward_passes", "acceptance_rate", "mean_accepted_length")
    try:
        http_decode(url, prompt_ids[0], QWEN_CONFIGS["dsbd"], 4, 0)  # warm up
        for round_ in range(args.rounds):
            for i, ids in enumerate(prompt_ids):
                forward = (round_ + i) % 2 == 0
                for name in list(QWEN_CONFIGS) if forward else list(reversed(QWEN_CONFIGS)):
                    out = http_decode(url, ids, QWEN_CONFIGS[name], n, 1000 * round_ + i)
                    per_token[name].append(out["client_seconds"] / out["stats"]["tokens_emitted"])
                    stats[name].append({k: out["stats"][k] for k in keep})
        seeds = [100 + i for i in range(len(prompt_ids))]
        sequential, concurrent, _ = throughput(url, prompt_ids, QWEN_CONFIGS["dsbd"], n, seeds)
        ratios = [d / b for d, b in zip(per_token["dsbd"], per_token["beam"], strict=True)]
        results = {
            "configs": QWEN_CONFIGS,
            "max_new_tokens": n,
            "prompts": prompts,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "per_token_s_median": {k: statistics.median(v) for k, v in per_token.items()},
            "dsbd_over_beam_time_median": statistics.median(ratios),
            "dsbd_speedup_per_token_median": statistics.median(1 / r for r in ratios),
            "stats": stats,
            "dsbd_throughput_tokens_per_s": {"sequential": sequential, "concurrent": concurrent},
            "dsbd_concurrency_gain": concurrent / sequential,
        }
        save(args.out, results)
        print(json.dumps({k: v for k, v in results.items() if k != "stats"}, indent=1))
    finally:
        stop_server(process, info["pid"])


def run_overhead(args: argparse.Namespace, pair: ServedPair) -> None:
    """Per config, the router's wall time minus the replicas' compute per iteration (ms)."""
    prompt_ids = chat_ids(pair.target, [pair.prompts[0]])[0]
    workdir = Path(tempfile.mkdtemp(prefix="dsbd-overhead-"))
    process, info = start_server(workdir, args.port, args.batch_wait_s, pair.target, pair.draft)
    overhead: dict[str, list[float]] = {name: [] for name in ("beam", "dsbd")}
    try:
        http_decode(info["url"], prompt_ids, CONFIGS["dsbd"], 4, 0)  # warm up
        for rep in range(args.rounds):
            for name in overhead:
                out = http_decode(info["url"], prompt_ids, CONFIGS[name], args.max_new_tokens, rep)
                serving = out["stats"]["serving"]
                compute = sum(serving["verify_seconds"]) + sum(serving["draft_seconds"])
                per_iteration = (serving["wall_seconds"] - compute) / out["stats"]["iterations"]
                overhead[name].append(per_iteration * 1e3)
    finally:
        stop_server(process, info["pid"], wait_s=120)
    results = {
        "env_RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": os.environ.get(
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "default"
        ),
        "overhead_ms_per_iteration": overhead,
        "median_ms": {k: statistics.median(v) for k, v in overhead.items()},
    }
    save(args.out, results)
    print(json.dumps(results["median_ms"]))


def plot(results: dict, path: Path) -> None:
    """Per config: ms per token in-process and served (left), the concurrency gain (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in CONFIGS if n in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(names))
    left.bar(
        [i - 0.2 for i in x],
        [results[n]["per_token_s"]["in_process"] * 1e3 for n in names],
        0.4,
        label="in-process",
    )
    left.bar(
        [i + 0.2 for i in x],
        [results[n]["per_token_s"]["distributed"] * 1e3 for n in names],
        0.4,
        label="Ray Serve (HTTP)",
    )
    left.set_xticks(list(x), names)
    left.set_ylabel("ms per token (median)")
    left.set_title("one request at a time")
    left.legend()
    right.bar(list(x), [results[n]["concurrency_gain"] for n in names], 0.5)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xticks(list(x), names)
    right.set_ylabel(f"throughput, {results['concurrency']} concurrent / sequential")
    right.set_title("concurrency gain")
    fig.suptitle("SmolLM2-135M target, embedded draft, W=3, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
