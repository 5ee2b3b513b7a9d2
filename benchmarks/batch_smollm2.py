"""`dsbd batch` throughput on the embedded pair: rows decoded together vs one at a time.

The same 16 chat prompts (dsbd_core.tools.prompts: the English and code evaluation prompts, seed =
row index) go through the real job twice per round, `--batch-size 16` (one actor call decodes
all rows, sharing every forward) and `--batch-size 1` (one row per call), one actor with one
torch thread, on one local Ray started once; the order alternates per round.

    .venv/bin/python benchmarks/batch_smollm2.py [--rounds 2] [--max-new-tokens 32]

Reported per run: job wall time (actor start and model loading included), decode time (batch
16: the batch's decode; batch 1: the sum of the rows'), tokens, tokens/s of both, and whether
every row decoded the same tokens in both modes. Writes benchmarks/results/batch_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import ray

from deployments.local_ray import start_local_ray
from dsbd.cli import main as dsbd
from dsbd_core.tools.prompts import EVAL_PROMPTS


def run(source: Path, out: Path, batch_size: int, max_new_tokens: int) -> dict:
    start = time.perf_counter()
    flags = ["--batch-size", str(batch_size), "--max-new-tokens", str(max_new_tokens)]
    status = dsbd(["batch", "--input", str(source), "--output", str(out), "--no-progress", *flags])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/batch_smollm2.json")
    args = parser.parse_args()
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
            for size in (16, 1) if round_ % 2 == 0 else (1, 16):
                out = work / f"out-{round_}-{size}.jsonl"
                result = run(source, out, size, args.max_new_tokens)
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
    out = {
        "what": f"dsbd batch, {len(prompts)} chat prompts, batch size 16 vs 1, one actor",
        "method": "dsbd (defaults: W=3, gamma=3, threshold=0.7), float32, 1 torch thread",
        "max_new_tokens": args.max_new_tokens,
        "machine": platform.platform(),
        "same_tokens_batched_and_alone": same,
        "throughput_ratio_batched_over_alone": summary,
        "runs": [{k: v for k, v in r.items() if k != "tokens_by_id"} for r in runs],
    }
    print(json.dumps({"same_tokens": same, **summary}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
