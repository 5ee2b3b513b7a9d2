"""DSBD against beam sampling through the server, on the real Qwen2.5-Coder 0.5B -> 1.5B pair.

Both decoders run through `dsbd serve` (router, draft, verifier on loopback Ray), one request at
a time, alternating which goes first per prompt, then 4 DSBD requests at once vs one by one.
Needs `dsbd models install qwen-coder`. Not a timed test:

    .venv/bin/python benchmarks/serving_qwen.py [--max-new-tokens 64]

Writes benchmarks/results/serving_qwen.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serving_smollm2 import http_decode, start_server  # benchmarks/ is on sys.path

from dsbd_core.models import load_tokenizer

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that counts the vowels in a string.",
]
# DSBD at the server's default knobs (fixed width W = 3, the cost model choosing the depth up to
# gamma = 3 each iteration), with four draft beams per layer (W_S = 4, the fastest measured)
CONFIGS = {
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--out", default="benchmarks/results/serving_qwen.json")
    args = parser.parse_args()
    tokenizer, _ = load_tokenizer("qwen-coder")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="dsbd-bench-qwen-"))
    process, info = start_server(
        workdir, args.port, 0.01, "qwen-coder", "qwen-coder-draft", "qwen-coder"
    )
    url, n = info["url"], args.max_new_tokens
    per_token: dict[str, list[float]] = {name: [] for name in CONFIGS}
    stats: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    try:
        http_decode(url, prompt_ids[0], CONFIGS["dsbd"], 4, 0)  # warm up
        for i, ids in enumerate(prompt_ids):
            names = list(CONFIGS) if i % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                out = http_decode(url, ids, CONFIGS[name], n, i)
                per_token[name].append(out["client_seconds"] / out["stats"]["tokens_emitted"])
                stats[name].append(
                    {
                        k: out["stats"][k]
                        for k in (
                            "tokens_emitted",
                            "target_forward_passes",
                            "acceptance_rate",
                            "mean_accepted_length",
                        )
                    }
                )
        ratios = [d / b for d, b in zip(per_token["dsbd"], per_token["beam"], strict=True)]
        throughput = {}
        for mode in ("sequential", "concurrent"):
            start = time.perf_counter()
            if mode == "sequential":
                outs = [
                    http_decode(url, ids, CONFIGS["dsbd"], n, 100 + i)
                    for i, ids in enumerate(prompt_ids)
                ]
            else:
                with ThreadPoolExecutor(len(prompt_ids)) as pool:
                    futures = [
                        pool.submit(http_decode, url, ids, CONFIGS["dsbd"], n, 100 + i)
                        for i, ids in enumerate(prompt_ids)
                    ]
                    outs = [f.result() for f in futures]
            tokens = sum(o["stats"]["tokens_emitted"] for o in outs)
            throughput[mode] = tokens / (time.perf_counter() - start)
        write_results(args.out, per_token, ratios, stats, throughput, n, load_before)
    finally:
        os.kill(info["pid"], signal.SIGINT)
        process.wait(timeout=180)


def write_results(
    out: str,
    per_token: dict,
    ratios: list,
    stats: dict,
    throughput: dict,
    n: int,
    load_before: tuple,
) -> None:
    """The figures, written before the server is stopped (a slow stop must not lose them)."""
    results = {
        "configs": CONFIGS,
        "max_new_tokens": n,
        "prompts": PROMPTS,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "per_token_s_median": {k: statistics.median(v) for k, v in per_token.items()},
        "dsbd_over_beam_time_median": statistics.median(ratios),
        "dsbd_speedup_per_token_median": statistics.median(1 / r for r in ratios),
        "stats": stats,
        "dsbd_throughput_tokens_per_s": throughput,
        "dsbd_concurrency_gain": throughput["concurrent"] / throughput["sequential"],
    }
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "stats"}, indent=1))


if __name__ == "__main__":
    main()
