"""Cross-session batching on the embedded pair: N prompts in one batched decode vs one by one.

The engine decodes a batch of sessions in lockstep and `TransformerScorer` runs every session's
forest in ONE model forward per iteration, so N concurrent requests cost far less than N times
one. Side by side in one process, alternating the two orders per method:

    .venv/bin/python benchmarks/batching_smollm2.py [--prompts 8] [--max-new-tokens 32]

Writes benchmarks/results/batching_smollm2.json. Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dsbd_core import SamplingConfig, generate, generate_batch
from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids
from dsbd_core.models.transformer_scorer import TransformerScorer

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France?",
    "Give three tips for learning to cook.",
    "Describe a bicycle to a child.",
    "Why do we have seasons?",
    "Name three primary colours.",
    "What does a compiler do?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/batching_smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = load_causal_lm("smollm2"), load_causal_lm("smollm2-draft")
    prompts = [encode_prompt(target, p) for p in (PROMPTS * 4)[: args.prompts]]
    config = SamplingConfig(
        width=3,
        gamma=3,
        max_new_tokens=args.max_new_tokens,
        seed=0,
        eos_token_ids=stop_token_ids(target),
    )
    results = {}

    def sequential(method: str) -> tuple[float, int]:
        start, tokens = time.perf_counter(), 0
        for ids in prompts:
            r = generate(
                method, TransformerScorer(target.model), ids, config, TransformerScorer(draft.model)
            )
            tokens += r.stats.tokens_emitted
        return time.perf_counter() - start, tokens

    def batched(method: str) -> tuple[float, int]:
        start = time.perf_counter()
        rs = generate_batch(
            method, TransformerScorer(target.model), prompts, config, TransformerScorer(draft.model)
        )
        return time.perf_counter() - start, sum(r.stats.tokens_emitted for r in rs)

    for method in ("beam", "dsbd"):
        seq_s, seq_tokens = sequential(method)
        bat_s, bat_tokens = batched(method)
        results[method] = {
            "sequential_seconds": seq_s,
            "sequential_tokens": seq_tokens,
            "batched_seconds": bat_s,
            "batched_tokens": bat_tokens,
            "throughput_ratio": (bat_tokens / bat_s) / (seq_tokens / seq_s),
        }
        print(method, json.dumps(results[method]))
    out = {
        "what": f"{args.prompts} prompts batched in one decode vs one by one, embedded pair",
        "config": config.model_dump(mode="json"),
        "machine": platform.platform(),
        "threads": 1,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
