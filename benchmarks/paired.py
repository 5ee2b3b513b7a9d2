"""Two methods of one `dsbd bench` run compared directly, paired over the prompts both decoded:
the second method as the reference instead of our beam sampling at the same W (what the run's
table uses), e.g. DSBD under transformers' law against transformers' own beam sampling.

    .venv/bin/python benchmarks/paired.py benchmarks/results/bench_qwen-coder_laws_humaneval_epyc \\
        dsbd-w3-g3-fixed-tf hf-beam-w3

Prints the speed ratio (the reference's time per token over the method's) with its 95 %
bootstrap interval, the per-token log-likelihood and pass@1 differences with theirs, and each
request's speed ratio with the requests below `--floor` (0.97: issue 35's per-request bound).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsbd.bench.decode.harness import read_records
from dsbd.bench.decode.report import compare
from dsbd.bench.decode.schema import BenchResult


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a dsbd bench output directory")
    parser.add_argument("method")
    parser.add_argument("reference")
    parser.add_argument("--floor", type=float, default=0.97, help="per-request speed bound")
    args = parser.parse_args(argv)
    if (args.run / "records.jsonl").is_file():
        records = read_records(args.run / "records.jsonl")
    else:  # a committed run keeps results.json, which holds every record
        records = BenchResult.model_validate_json((args.run / "results.json").read_text()).records
    summary = compare(records, args.method, args.reference)
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
    ratios = per_request(records, args.method, args.reference)
    below = [(prompt, ratio) for prompt, ratio in ratios if ratio < args.floor]
    print(f"  per request: {len(below)} of {len(ratios)} below {args.floor}x", end="")
    print(": " + ", ".join(f"{p} {r:.3f}x" for p, r in below) if below else "")
    if ratios:
        print(f"  slowest request: {min(r for _, r in ratios):.3f}x")
    # a request whose decode never ran the draft did a beam decode's work: its ratio is the
    # machine's run-to-run noise, the spread every other ratio carries too
    drafted = {r.prompt_id for r in records if r.method == args.method and r.draft_forward_passes}
    for label, group in (
        ("drafted", [x for x in ratios if x[0] in drafted]),
        ("never drafted (noise)", [x for x in ratios if x[0] not in drafted]),
    ):
        if group:
            values = sorted(r for _, r in group)
            low = sum(r < args.floor for r in values)
            print(f"  {label}: {len(values)} requests, {values[0]:.3f}x-{values[-1]:.3f}x,", end="")
            print(f" {low} below {args.floor}x")
    return 0


def per_request(records: list, method: str, reference: str) -> list[tuple[str, float]]:
    """(prompt, the reference's seconds per token over the method's) for every prompt both
    decoded (the median of the timing rounds where the run had several)."""
    ours = {r.prompt_id: r for r in records if r.method == method}
    theirs = {r.prompt_id: r for r in records if r.method == reference}
    return [
        (prompt, (theirs[prompt].seconds / theirs[prompt].tokens) / (r.seconds / r.tokens))
        for prompt, r in ours.items()
        if prompt in theirs
    ]


if __name__ == "__main__":
    raise SystemExit(main())
