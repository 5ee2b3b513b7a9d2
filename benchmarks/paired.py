"""Two methods of one `dsbd bench` run compared directly, paired over the prompts both decoded:
the second method as the reference instead of our beam sampling at the same W (what the run's
table uses), e.g. DSBD under transformers' law against transformers' own beam sampling.

    .venv/bin/python benchmarks/paired.py benchmarks/results/bench_qwen-coder_laws_humaneval_epyc \\
        dsbd-w3-g3-fixed-tf hf-beam-w3

Prints the speed ratio (the reference's time per token over the method's) with its 95 %
bootstrap interval, and the per-token log-likelihood and pass@1 differences with theirs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsbd_core.tools.bench.harness import read_records
from dsbd_core.tools.bench.report import compare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a dsbd bench output directory")
    parser.add_argument("method")
    parser.add_argument("reference")
    args = parser.parse_args(argv)
    summary = compare(read_records(args.run / "records.jsonl"), args.method, args.reference)
    time = summary.time_vs_reference
    print(f"{args.method} against {args.reference} ({summary.prompts} prompts)")
    if time is not None:
        print(f"  speed: {1 / time.value:.3f}x [{1 / time.high:.3f}, {1 / time.low:.3f}]")
    differences = (
        ("log-lik/token", summary.loglik_vs_reference),
        ("pass@1", summary.pass_vs_reference),
    )
    for name, value in differences:
        if value is not None:
            print(f"  Δ {name}: {value.value:+.3f} [{value.low:+.3f}, {value.high:+.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
