"""The distributed path (Ray Serve: router, draft, verifier) against the in-process engine.

Two figures on the embedded SmolLM2 pair, side by side in one run (this machine is shared and
noisy, so every comparison alternates its two sides and is reported as a ratio):

1. **Per-token latency overhead**: one request at a time, the same prompt, seed and config
   (`adaptive: false`, so both sides decode the very same tokens), decoded in-process by
   `Engine.run` and over HTTP by `dsbd serve`. Overhead = distributed / in-process - 1.
2. **Concurrency gain**: N requests sent all at once vs the same N one after the other, both over
   HTTP. Gain = concurrent throughput / sequential throughput (tokens per second).

    .venv/bin/python benchmarks/serving_smollm2.py [--rounds 3] [--max-new-tokens 32]

It starts `dsbd serve` itself (loopback only), with one torch thread per model replica and the
in-process side on one thread too. Writes benchmarks/results/serving_smollm2.json and a plot.
Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
import yaml
from batching_smollm2 import PROMPTS  # benchmarks/ is on sys.path when run as a script

from dsbd import server_process
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.decoders import generate
from dsbd_core.models import LoadedModel, encode_prompt, load_causal_lm, stop_token_ids
from dsbd_core.models.transformer_scorer import TransformerScorer

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    "dsbd": {"method": "dsbd", "width": 3, "gamma": 2, "threshold": 0.7},
    "beam": {"method": "beam", "width": 3},
}


def start_server(
    workdir: Path,
    port: int,
    batch_wait_s: float,
    target: str = "smollm2",
    draft: str = "smollm2-draft",
    model_name: str = "smollm2",
) -> tuple[subprocess.Popen, dict]:
    """`dsbd serve` on the pair, one torch thread per model; returns the process and ready info."""
    models = {"threads": 1, "batch_wait_s": batch_wait_s}
    args = {
        "model_name": model_name,
        "target": {"source": target, **models},
        "draft": {"source": draft, **models},
        "router_resources": {"num_cpus": 0.1},
        "draft_resources": {"num_cpus": 0.5},
        "verifier_resources": {"num_cpus": 1},
    }
    app = {
        "name": "dsbd",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": args,
    }
    return launch(workdir, port, [app])


def launch(workdir: Path, port: int, applications: list[dict]) -> tuple[subprocess.Popen, dict]:
    """`dsbd serve --config` with these Serve applications (dsbd/server_process.py; log in
    workdir/server.log); returns the process and its ready file's info (url, pid)."""
    config = workdir / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": applications}))
    server = server_process.start(workdir, config, num_cpus=4, port=port, timeout_s=600)
    return server.process, {"url": server.base_url, "pid": server.pid}


def http_decode(url: str, prompt_ids: list[int], knobs: dict, max_new: int, seed: int) -> dict:
    body = {
        "prompt_ids": prompt_ids,
        "seed": seed,
        "max_new_tokens": max_new,
        "adaptive": False,
        **knobs,
    }
    start = time.perf_counter()
    response = requests.post(f"{url}/v1/dsbd/generate", json=body, timeout=600)
    response.raise_for_status()
    out = response.json()
    out["client_seconds"] = time.perf_counter() - start
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--batch-wait-s", type=float, default=0.01)
    parser.add_argument("--out", default="benchmarks/results/serving_smollm2.json")
    return parser.parse_args()


def measure_latency(
    args: argparse.Namespace,
    url: str,
    pair: tuple[LoadedModel, LoadedModel],
    prompts: list[list[int]],
    stops: tuple[int, ...],
    knobs: dict,
) -> dict:
    """Figure 1: per-token latency in-process vs over HTTP, one request at a time, alternating.

    `pair` is the (target, draft) loaded in this process; `adaptive: false` on the HTTP side
    makes both sides decode the very same tokens, which `same_tokens` checks.
    """
    target, draft = pair
    method = knobs["method"]
    config_knobs = {k: v for k, v in knobs.items() if k != "method"}
    latency = {"in_process": [], "distributed": [], "server_side": [], "same_tokens": []}
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
    """Figure 2: the same N requests one by one vs all at once over HTTP, alternating."""
    # concurrency: the same N requests one by one vs all at once, alternating
    seq, conc, batches = [], [], []
    for round_ in range(args.rounds):
        for mode in ("seq", "conc") if round_ % 2 == 0 else ("conc", "seq"):
            seeds = [5000 + 100 * round_ + i for i in range(len(prompts))]
            start = time.perf_counter()
            if mode == "seq":
                outs = [
                    http_decode(url, ids, knobs, args.max_new_tokens, s)
                    for ids, s in zip(prompts, seeds, strict=True)
                ]
            else:
                with ThreadPoolExecutor(len(prompts)) as pool:
                    futures = [
                        pool.submit(http_decode, url, ids, knobs, args.max_new_tokens, s)
                        for ids, s in zip(prompts, seeds, strict=True)
                    ]
                    outs = [f.result() for f in futures]
                for out in outs:
                    batches += out["stats"]["serving"]["verify_batch_requests"]
            seconds = time.perf_counter() - start
            tokens = sum(o["stats"]["tokens_emitted"] for o in outs)
            (seq if mode == "seq" else conc).append(tokens / seconds)
    return {
        "throughput_tokens_per_s": {
            "sequential": statistics.median(seq),
            "concurrent": statistics.median(conc),
        },
        "concurrency_gain": statistics.median([c / s for c, s in zip(conc, seq, strict=True)]),
        "mean_verifier_batch_requests_concurrent": statistics.fmean(batches),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    target, draft = load_causal_lm("smollm2"), load_causal_lm("smollm2-draft")
    stops = stop_token_ids(target)
    prompts = [encode_prompt(target, p) for p in PROMPTS[: args.concurrency]]
    workdir = Path(tempfile.mkdtemp(prefix="dsbd-bench-"))
    process, info = start_server(workdir, args.port, args.batch_wait_s)
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
    finally:
        os.kill(info["pid"], signal.SIGINT)
        process.wait(timeout=120)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}", file=sys.stderr)


def plot(results: dict, path: Path) -> None:
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


if __name__ == "__main__":
    main()
