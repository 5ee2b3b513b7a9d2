"""What batch-invariant forwards cost: batched seeded decodes, this tree against a git revision.

A batched forward attends each session alone over its own cache and computes bfloat16 linear
layers in chunks of at most 32 rows (docs/SERVING.md "Seeded decodes and numerics"); before
that, sessions' caches were copied into one column-aligned layout and the linear layers ran
over all rows at once. This decodes `--requests` seeded DSBD requests together
(`decode_lockstep`: one shared draft and one shared target forward per round, as the serving
replicas batch them) on the SmolLM2 pair in bfloat16, in a fresh process per run,
alternating this working tree (batch-invariant, the default, and `batch_invariant=False`) with
a checkout of `--baseline` (a git worktree made under /tmp), and reports each one's seconds per
run, the ratios to the baseline and the load average before and after. Nothing else may run on
the machine meanwhile. `--requests 1` times a decode alone (no batching); `--quantize int8`
runs the int8 draft (per-row activations here, per-call in the baseline).

    B=benchmarks/investigations/batch_invariance
    .venv/bin/python $B/batch_cost.py --baseline 83d9f34     # writes $B/results/batch_cost.json
    .venv/bin/python $B/batch_cost.py --baseline 83d9f34 --requests 1 --tokens 48 \
        --out $B/results/batch_cost_alone.json
    .venv/bin/python $B/batch_cost.py --baseline 83d9f34 --quantize int8 \
        --out $B/results/batch_cost_int8.json      # and with --requests 1 ... alone_int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository
RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.models import load_tokenizer
from dsbd_core.models.pair import DraftOptions, load_pair
from dsbd_core.models.transformer_scorer import TransformerScorer
requests, tokens, quantize = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
kw = {} if sys.argv[3] == '1' else {'batch_invariant': False}
pair = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="bfloat16",
                 draft_options=DraftOptions(quantize=quantize))
_, stop = load_tokenizer(DEFAULT_TARGET)
prompts = [[5 + 13 * i + j for j in range(4 + 3 * (i % 5))] for i in range(requests)]
def run(seed0):
    batch = [Request(p, SamplingConfig(eos_token_ids=stop, seed=seed0 + i, max_new_tokens=tokens,
                                       width=3 - i % 2, gamma=3)) for i, p in enumerate(prompts)]
    target = SessionBatcher(TransformerScorer(pair.target.model, **kw))
    draft = SessionBatcher(TransformerScorer(pair.draft.model, **kw))
    start = time.perf_counter()
    results, _ = decode_lockstep(batch, target, draft)
    seconds = time.perf_counter() - start
    made = sum(len(r.result.beams[0].token_ids) for r in results if r.result is not None)
    return seconds, made
run(1000)  # warm-up: oneDNN primitives, allocator
seconds, made = run(0)
print(json.dumps({"seconds": seconds, "tokens": made}))
"""


def one_run(tree: Path, invariant: bool, requests: int, tokens: int, quantize: str) -> dict:
    """One decode in a fresh process importing the package from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-c",
        CHILD,
        str(requests),
        str(tokens),
        str(int(invariant)),
        quantize,
    ]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_tree(revision: str) -> Path:
    """A worktree of `revision` under /tmp (made once, reused)."""
    path = Path("/tmp") / f"dsbd-baseline-{revision}"
    if not path.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), revision],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare with")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--quantize",
        default="none",
        choices=("none", "int8"),
        help="the draft's linear layers (int8: what auto picks here)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_cost.json")
    args = parser.parse_args()
    trees = {
        "batch-invariant (default)": (ROOT, True),
        "batch_invariant=False": (ROOT, False),
        f"baseline {args.baseline}": (baseline_tree(args.baseline), True),
    }
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(reversed(trees))  # interleaved
        for name in order:
            runs[name].append(one_run(*trees[name], args.requests, args.tokens, args.quantize))
            print(name, runs[name][-1], flush=True)
    load_after = os.getloadavg()
    median = {name: statistics.median(r["seconds"] for r in done) for name, done in runs.items()}
    invariant, fast, old = median.values()
    results = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "requests": args.requests,
        "max_new_tokens": args.tokens,
        "repeats": args.repeats,
        "quantize": args.quantize,
        "runs": runs,
        "median_s": median,
        "ratio_invariant_over_baseline": invariant / old,
        "ratio_not_invariant_over_baseline": fast / old,
        "load_before": load_before,
        "load_after": load_after,
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"median: invariant {invariant:.2f} s, not invariant {fast:.2f} s, baseline {old:.2f} s:"
        f" ratios {invariant / old:.3f}, {fast / old:.3f} (load {load_before[0]:.2f} -> "
        f"{load_after[0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
