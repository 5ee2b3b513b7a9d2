"""Which allocation keeps the steps of the draft's RSS in the soak
(docs/history/RELIABILITY-chronicle.md §10)?

The soaks saw the draft replica's RSS grow in steps that are never given back (+2.0 % and
+4.2 % over the last 20 minutes), and no per-request leak in the serving classes
(tests/serving/test_replica_leak.py): memory kept for shapes not seen before. This runs the serving
path's batching in one process, without Ray: rounds of 1 to 8 seeded DSBD requests of random
prompt lengths, widths, depths and lengths decoded together (`decode_lockstep` over one
`SessionBatcher` per model, kept across rounds as a replica keeps them), the process's RSS
after every round, for `--seconds` per variant. Each variant runs in a fresh process with its
environment: the defaults; oneDNN's primitive cache off (`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`:
no primitive, with its scratchpad, kept per shape); glibc's mmap threshold fixed
(`MALLOC_MMAP_THRESHOLD_`: large tensors always mmapped and returned on free, instead of the
dynamic threshold that, after a large free, serves later large tensors from the heap); jemalloc
(the one Ray ships) preloaded in place of glibc's malloc.

Growth is reported as the soak reports it (the mean of the last three samples over the mean of
the first three of the last two thirds of the run, minus one), with the rounds per second (a
setting that saves memory may cost speed; a ratio in one run, variants in turn).

    .venv/bin/python benchmarks/investigations/memory/memory_shapes.py --seconds 180
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path


def _jemalloc() -> str:
    """The jemalloc Ray ships, as the model replicas preload it
    (deployments/replicas/allocator.py)."""
    from deployments.replicas.allocator import jemalloc_library

    library = jemalloc_library()
    assert library is not None, "this Ray has no bundled libjemalloc.so"
    return str(library)


VARIANTS = {
    "defaults": {},
    "onednn_cache_off": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"},
    "mmap_threshold_128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "mmap_threshold_1m": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
    "jemalloc": {"LD_PRELOAD": "<jemalloc>"},
    # jemalloc with oneDNN's primitive cache (default 1024 entries) off or smaller
    **{
        f"jemalloc_onednn_cache_{n}": {
            "LD_PRELOAD": "<jemalloc>",
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(n),
        }
        for n in (0, 64, 128, 256)
    },
    # and PyTorch's own cache of oneDNN matmuls (ideep's, `LRU_CACHE_CAPACITY`, default 1024)
    **{
        f"jemalloc_caches_{n}": {
            "LD_PRELOAD": "<jemalloc>",
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(n),
            "LRU_CACHE_CAPACITY": str(n),
        }
        for n in (64, 128, 256)
    },
}


def child(seconds: float, seed: int) -> dict:
    """Decode random rounds for `seconds`; RSS (MiB) after each round."""
    import psutil
    import torch

    from deployments.replicas.allocator import allocator_stats
    from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET
    from dsbd_core import SamplingConfig
    from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
    from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
    from dsbd_core.models import load_tokenizer
    from dsbd_core.models.pair import load_pair
    from dsbd_core.models.transformer_scorer import TransformerScorer

    torch.set_num_threads(1)
    pair = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT)
    assert pair.draft is not None
    _, stop = load_tokenizer(DEFAULT_TARGET)
    target = SessionBatcher(TransformerScorer(pair.target.model))
    draft = SessionBatcher(TransformerScorer(pair.draft.model))
    rng = random.Random(seed)
    process = psutil.Process()
    samples, rounds, start, allocated = [], 0, time.monotonic(), []
    while time.monotonic() - start < seconds:
        requests = [
            Request(
                [rng.randrange(5, 40000) for _ in range(rng.randint(3, 60))],
                SamplingConfig(
                    eos_token_ids=stop,
                    seed=rng.randrange(2**31),
                    width=rng.randint(2, 4),
                    gamma=rng.randint(1, 3),
                    max_new_tokens=rng.randint(4, 24),
                ),
            )
            for _ in range(rng.randint(1, 8))
        ]
        decode_lockstep(requests, target, draft)
        rounds += 1
        samples.append((round(time.monotonic() - start, 2), process.memory_info().rss / 2**20))
        live = allocator_stats().get("allocated")  # jemalloc's live bytes (None under glibc)
        if live is not None:
            allocated.append((samples[-1][0], live / 2**20))
    return {"models": pair.describe(), "rounds": rounds, "samples": samples, "allocated": allocated}


def growth(samples: list[tuple[float, float]]) -> dict[str, float]:
    window = samples[len(samples) // 3 :]
    first = sum(v for _, v in window[:3]) / 3
    last = sum(v for _, v in window[-3:]) / 3
    return {
        "first_mib": round(first, 1),
        "last_mib": round(last, 1),
        "max_mib": round(max(v for _, v in window), 1),
        "growth": round(last / first - 1, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "memory_shapes.json",
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.seconds, args.seed)))
        return 0
    results = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": args.seconds,
        "load_before": os.getloadavg(),
        "variants": {},
    }
    for name in args.variants.split(","):
        variant = {k: _jemalloc() if v == "<jemalloc>" else v for k, v in VARIANTS[name].items()}
        env = {**os.environ, **variant, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--seconds",
                str(args.seconds),
                "--seed",
                str(args.seed),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        run = json.loads(done.stdout.strip().splitlines()[-1])
        found = {
            "env": variant,
            "rounds": run["rounds"],
            "rounds_per_s": round(run["rounds"] / args.seconds, 2),
            **growth(run["samples"]),
            "models": run["models"],
            "allocated": growth(run["allocated"]) if run["allocated"] else None,
            "samples": run["samples"],
        }
        results["variants"][name] = found
        print(
            f"{name}: {found['rounds']} rounds, RSS {found['first_mib']} -> "
            f"{found['last_mib']} MiB over the last 2/3 ({found['growth']:+.1%}), "
            f"max {found['max_mib']}; allocated {found['allocated']}",
            flush=True,
        )
    results["load_after"] = os.getloadavg()
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
