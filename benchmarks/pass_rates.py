"""The pair's pass rates per drafted layer as the cost model's calibration measures them
(`dsbd_core.models.calibrate.measure_pass_rates` on PASS_RATE_TEXTS): DSBD at its defaults
(W = 3, gamma = 3, fixed width) and one drafted beam (SpS), uncached, with the run's machine
and commit. A count of agreements, not a timing: the figure docs/MEASURED.md quotes for the
priors a request starts from.

    .venv/bin/python benchmarks/pass_rates.py --pair qwen-coder \
        --out benchmarks/results/pass_rates_qwen-coder.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dsbd.bench.decode.harness import git_info, machine_info
from dsbd.bench.decode.pairs import PAIRS
from dsbd_core.models.calibrate import measure_pass_rates, pass_rate_inputs
from dsbd_core.models.options import DraftOptions
from dsbd_core.models.pair import load_pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    parser.add_argument("--draft-quantize", default="int8", choices=["none", "int8"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair_spec = PAIRS[args.pair]
    pair = load_pair(
        pair_spec.target, pair_spec.draft, draft_options=DraftOptions(quantize=args.draft_quantize)
    )
    target, draft = pair.scorers()
    inputs = pass_rate_inputs(pair.target)
    stop_ids = tuple(inputs["stop_ids"])
    start = time.perf_counter()
    rates = {
        method: measure_pass_rates(target, draft, inputs["prompts"], stop_ids, method=method)
        for method in ("dsbd", "sps")
    }
    result = {
        "what": "pass rate per drafted layer depth, given the layer above passed",
        "pair": args.pair,
        "described": pair.describe(),
        "rates": rates,
        "seconds": round(time.perf_counter() - start, 1),
        "machine": machine_info(torch.device("cpu")),
        "git": git_info(),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
