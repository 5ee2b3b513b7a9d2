"""Where the distributed path's extra time goes: router wall time minus replica compute.

One request at a time through `dsbd serve` on the embedded SmolLM2 pair; for each iteration
the router's wall time minus the draft's and the verifier's batch compute (from the native
API's `stats.serving`) is what the Serve calls, the object store and the router cost. Beam
sampling makes one call per iteration, DSBD two (and moves the forest).

    .venv/bin/python benchmarks/serving_overhead.py [--reps 3]

Set RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 in the environment to compare that Serve
mode (it measured worse here: serving_overhead_same_thread.json, in git history at 45aeca3).
Writes benchmarks/results/serving_overhead.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
from pathlib import Path

from serving_smollm2 import PROMPTS, http_decode, start_server  # benchmarks/ is on sys.path

from dsbd_core.models import load_tokenizer

CONFIGS = {
    "beam": {"method": "beam", "width": 3},
    "dsbd": {"method": "dsbd", "width": 3, "gamma": 2, "threshold": 0.7},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--out", default="benchmarks/results/serving_overhead.json")
    args = parser.parse_args()
    tokenizer, _ = load_tokenizer("smollm2")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    process, info = start_server(Path(tempfile.mkdtemp(prefix="dsbd-overhead-")), args.port, 0.01)
    overhead: dict[str, list[float]] = {name: [] for name in CONFIGS}
    try:
        http_decode(info["url"], prompt_ids, CONFIGS["dsbd"], 4, 0)  # warm up
        for rep in range(args.reps):
            for name, knobs in CONFIGS.items():
                out = http_decode(info["url"], prompt_ids, knobs, args.max_new_tokens, rep)
                serving = out["stats"]["serving"]
                compute = sum(serving["verify_seconds"]) + sum(serving["draft_seconds"])
                per_iteration = (serving["wall_seconds"] - compute) / out["stats"]["iterations"]
                overhead[name].append(per_iteration * 1e3)
    finally:
        os.kill(info["pid"], signal.SIGINT)
        process.wait(timeout=120)
    results = {
        "env_RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": os.environ.get(
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "default"
        ),
        "overhead_ms_per_iteration": overhead,
        "median_ms": {k: statistics.median(v) for k, v in overhead.items()},
    }
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["median_ms"]))


if __name__ == "__main__":
    main()
