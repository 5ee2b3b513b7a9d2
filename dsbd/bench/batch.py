"""Batched decodes against one at a time on the embedded pair: the `dsbd batch` job, or
(`--in-process`) the engine's lockstep batching itself.

**The job** (default): the same 16 chat prompts (dsbd.prompts: the English and code
evaluation prompts, seed = row index) go through the real `dsbd batch` job twice per round,
`--batch-size 16` (one actor call decodes all rows, sharing every forward) and `--batch-size 1`
(one row per call), one actor with one torch thread, on one local Ray started once; the order
alternates per round. Reported per run: job wall time (actor start and model loading included),
decode time (batch 16: the batch's decode; batch 1: the sum of the rows'), tokens, tokens/s of
both, and whether every row decoded the same tokens in both modes. Writes
benchmarks/results/batch_smollm2.json.

**In-process** (`--in-process`): the engine decodes a batch of sessions in lockstep and
`TransformerScorer` runs every session's forest in ONE model forward per iteration, so N
concurrent requests cost far less than N times one. `--prompts` prompts (dsbd/prompts.py, the
`everyday` set) decoded by `generate_batch` at once against `generate` one by one, beam
sampling and DSBD, in this process on one torch thread. Writes
benchmarks/results/batching_smollm2.json.

    dsbd bench batch [--rounds 2] [--max-new-tokens 32]
    dsbd bench batch --in-process [--prompts 8] [--max-new-tokens 32]

Not timed tests: figures for docs/BATCH.md and README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from dsbd import batch_command
from dsbd.common import fail
from dsbd.prompts import EVERYDAY_PROMPTS as PROMPTS

DEFAULT_OUT = {
    "job": "benchmarks/results/batch_smollm2.json",
    "in-process": "benchmarks/results/batching_smollm2.json",
}
JOB_SIZES = (16, 1)  # rows per actor call: all of them, then one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dsbd bench batch`."""
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="the engine's lockstep batching in this process instead of the `dsbd batch` job",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="the job's rounds (default: 2)")
    parser.add_argument(
        "--prompts", type=int, default=8, help="--in-process: prompts batched (default: 8)"
    )
    parser.add_argument(
        "--out",
        help=f"JSON results (default: {DEFAULT_OUT['job']}; --in-process: "
        f"{DEFAULT_OUT['in-process']})",
    )


def run(args: argparse.Namespace) -> int:
    """Run `dsbd bench batch`."""
    for flag in ("max_new_tokens", "rounds", "prompts"):
        if (value := getattr(args, flag)) < 1:
            return fail(f"--{flag.replace('_', '-')}={value}: allowed >= 1")
    mode = "in-process" if args.in_process else "job"
    results = in_process(args) if args.in_process else job(args)
    out = Path(args.out or DEFAULT_OUT[mode])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def dsbd_batch(argv: list[str]) -> int:
    """`dsbd batch ARGV`, through that command's own parser and handler."""
    parser = argparse.ArgumentParser(prog="dsbd")
    batch_command.add_parser(parser.add_subparsers(dest="command", required=True))
    return batch_command.run(parser.parse_args(["batch", *argv]))


def job_run(source: Path, out: Path, batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    """One `dsbd batch` job over `source`; its times, tokens and every row's tokens."""
    start = time.perf_counter()
    flags = ["--batch-size", str(batch_size), "--max-new-tokens", str(max_new_tokens)]
    status = dsbd_batch(["--input", str(source), "--output", str(out), "--no-progress", *flags])
    wall = time.perf_counter() - start
    assert status == 0, status
    records = [json.loads(line) for p in out.glob("*.jsonl") for line in p.read_text().splitlines()]
    assert all(r["error"] is None for r in records), [r["error"] for r in records]
    seconds = [r["stats"]["seconds"] for r in records]
    decode = max(seconds) if batch_size >= len(records) else sum(seconds)
    tokens = sum(r["stats"]["tokens_emitted"] for r in records)
    return {
        "batch_size": batch_size,
        "wall_seconds": wall,
        "decode_seconds": decode,
        "tokens": tokens,
        "tokens_per_s_wall": tokens / wall,
        "tokens_per_s_decode": tokens / decode,
        "tokens_by_id": {r["id"]: r["token_ids"] for r in records},
    }


def job(args: argparse.Namespace) -> dict[str, Any]:
    """The `dsbd batch` job at batch size 16 and 1, alternating per round, on one local Ray."""
    import ray

    from deployments.local_ray import start_local_ray
    from dsbd.prompts import EVAL_PROMPTS

    prompts = [p.text for p in EVAL_PROMPTS if p.kind in ("english", "code")]
    work = Path(tempfile.mkdtemp(prefix="dsbd-batch-bench-"))
    source = work / "prompts.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": t, "seed": i}) + "\n"
            for i, t in enumerate(prompts)
        )
    )
    start_local_ray(num_cpus=2, namespace="batch-bench")
    runs = []
    try:
        for round_ in range(args.rounds):
            for size in JOB_SIZES if round_ % 2 == 0 else JOB_SIZES[::-1]:
                out = work / f"out-{round_}-{size}.jsonl"
                result = job_run(source, out, size, args.max_new_tokens)
                runs.append({"round": round_, **result})
                shown = {k: v for k, v in result.items() if k != "tokens_by_id"}
                print(json.dumps(shown), flush=True)
    finally:
        ray.shutdown()
    same = all(r["tokens_by_id"] == runs[0]["tokens_by_id"] for r in runs)

    def mean(size: int, key: str) -> float:
        values = [r[key] for r in runs if r["batch_size"] == size]
        return sum(values) / len(values)

    summary = {
        key: mean(16, key) / mean(1, key) for key in ("tokens_per_s_wall", "tokens_per_s_decode")
    }
    print(json.dumps({"same_tokens": same, **summary}))
    return {
        "what": f"dsbd batch, {len(prompts)} chat prompts, batch size 16 vs 1, one actor",
        "method": "dsbd (defaults: W=3, gamma=3, threshold=0.7), float32, 1 torch thread",
        "max_new_tokens": args.max_new_tokens,
        "machine": platform.platform(),
        "same_tokens_batched_and_alone": same,
        "throughput_ratio_batched_over_alone": summary,
        "runs": [{k: v for k, v in r.items() if k != "tokens_by_id"} for r in runs],
    }


def in_process(args: argparse.Namespace) -> dict[str, Any]:
    """`generate_batch` over the prompts at once against `generate` one by one, per method."""
    import torch

    from dsbd_core import SamplingConfig, generate, generate_batch
    from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids
    from dsbd_core.models.transformer_scorer import TransformerScorer

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
    return {
        "what": f"{args.prompts} prompts batched in one decode vs one by one, embedded pair",
        "config": config.model_dump(mode="json"),
        "machine": platform.platform(),
        "threads": 1,
        "results": results,
    }
