"""The same decodes at two checkouts, interleaved: did a change make the CPU decode slower?

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/commits_paired.py /tmp/before . [--rounds 5] \\
        [--methods beam,dsbd] [--prompts 3] [--max-new-tokens 32] [--out F]

Each round runs one process per checkout, in alternating order, with one torch thread; each
process loads the embedded pair (SmolLM2-135M and its draft, the preset's dtype and draft variant
chosen for this CPU), decodes every prompt with every method once unrecorded, then once timed
(seeded; the cost model off: `--gamma` drafted every iteration, so both checkouts do the same
work), and prints its seconds. A method's figure is the median over rounds of its summed
seconds; the ratio is before / after (above 1: the change is faster). The load average is
recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# What one process runs (its checkout on sys.path first): prints {method: seconds} as JSON.
WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from dsbd_core import SamplingConfig, generate
from dsbd_core.models.pair import load_pair
from dsbd.prompts import prompt_set
methods, prompts, tokens = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
pair = load_pair("smollm2", "smollm2-draft")
target, draft = pair.scorers()
texts = [p.text for p in prompt_set("held-out")[:prompts]]
seconds = {}
for rep in range(2):
    for method in methods:
        config = SamplingConfig(width=3, gamma=3, max_new_tokens=tokens, seed=7,
                                eos_token_ids=pair.stop_ids)
        start = time.perf_counter()
        for text in texts:
            generate(method, target, pair.encode(text), config,
                     draft=draft if method != "beam" else None)
        if rep:
            seconds[method] = time.perf_counter() - start
print("RESULT " + json.dumps(seconds))
"""


def run(checkout: Path, methods: str, prompts: int, tokens: int) -> dict[str, float]:
    """One process at `checkout`: its seconds per method."""
    env = os.environ | {"PYTHONPATH": str(checkout.resolve()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, methods, str(prompts), str(tokens)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--methods", default="beam,dsbd")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    times: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for which in order:
            checkout = args.before if which == "before" else args.after
            for method, s in run(checkout, args.methods, args.prompts, args.max_new_tokens).items():
                times[which].setdefault(method, []).append(s)
        print(f"round {round_ + 1}: {json.dumps(times)}", flush=True)
    medians = {w: {m: statistics.median(s) for m, s in t.items()} for w, t in times.items()}
    result = {
        "before": str(args.before),
        "after": str(args.after),
        "rounds": args.rounds,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "seconds": times,
        "median_seconds": medians,
        "before_over_after": {
            m: medians["before"][m] / medians["after"][m] for m in medians["after"]
        },
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
