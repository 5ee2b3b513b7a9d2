"""What the engine's random draws cost on this CPU: counter-hash uniforms against a generator's
`uniform_`, and the distinct draw (sequential inverse transform) against a Gumbel top-k.

    .venv/bin/python benchmarks/draw_cost.py [--vocab 151936] [--width 3] [--rounds 30] \\
        [--out benchmarks/results/draw_cost_<cpu>.json]

Every figure is the median over `--rounds` rounds of one call, methods interleaved within each
round, one torch thread, in one process; the load average is recorded before and after. What
each row times:

* `generator_uniform_*`: `torch.rand` from a seeded `torch.Generator` over W x V numbers (the
  draws' source before counter hashing: one vocabulary-wide noise tensor per distinct draw);
* `hash_uniform_*_vocab`: `streams.counter_uniforms` over the same W x V numbers: the cost a
  Gumbel top-k keyed by candidate would pay on the host;
* `hash_uniform_small`: the same for a [1, W] draw, what every engine draw asks for now;
* `distinct_gumbel`: W distinct draws from a [1, W x V] float32 table by Gumbel top-k with
  generator noise (the engine's former `draw_distinct`, kept here as the baseline);
* `distinct_sequential`: `distributions.draw_distinct` on the same table (n uniforms a row).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsbd_core.algorithm.draws.distributions import draw_distinct
from dsbd_core.algorithm.draws.streams import Draws, counter_uniforms


def gumbel_distinct(probs: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """The former distinct draw: Gumbel top-k over generator noise (indices only)."""
    u = torch.rand(probs.shape, generator=generator, dtype=probs.dtype)
    exponential = u.clamp_min(1e-300).log_().neg_()
    keys = torch.div(probs, exponential, out=exponential)
    return keys.topk(n, dim=-1).indices


def cpu_name() -> str:
    """The CPU's model name and whether it has AMX (lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if "Model name" in line]
    model = names[0] if names else ""
    return f"{model}{', AMX' if 'amx_bf16' in text else ', no AMX'}"


def commit() -> str:
    """The checkout's commit, with '-dirty' where the code differs from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "dsbd_core", "benchmarks/draw_cost.py"],
        capture_output=True,
        text=True,
    ).stdout
    return head.strip() + ("-dirty" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = args.width * args.vocab
    cpu = torch.device("cpu")
    table = torch.softmax(
        torch.randn(1, size, generator=torch.Generator().manual_seed(0)) * 3, dim=-1
    )
    generator = torch.Generator().manual_seed(1)
    draws = Draws.seeded(1)
    cases: dict[str, Callable[[], object]] = {
        "generator_uniform_float32": lambda: torch.rand(
            (1, size), generator=generator, dtype=torch.float32
        ),
        "generator_uniform_float64": lambda: torch.rand(
            (1, size), generator=generator, dtype=torch.float64
        ),
        "hash_uniform_float32_vocab": lambda: counter_uniforms(3, (1, size), torch.float32, cpu),
        "hash_uniform_float64_vocab": lambda: counter_uniforms(3, (1, size), torch.float64, cpu),
        "hash_uniform_small": lambda: draws.uniform((1, args.width), torch.float64, cpu),
        "distinct_gumbel": lambda: gumbel_distinct(table, args.width, generator),
        "distinct_sequential": lambda: draw_distinct(table, args.width, draws),
    }
    load_before = os.getloadavg()
    for case in cases.values():  # warm-up
        case()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    result = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "threads": 1,
        "commit": commit(),
        "vocab": args.vocab,
        "width": args.width,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": load_after,
        "median_ms": ms,
        "ratios": {
            "hash_over_generator_float32": ms["hash_uniform_float32_vocab"]
            / ms["generator_uniform_float32"],
            "hash_over_generator_float64": ms["hash_uniform_float64_vocab"]
            / ms["generator_uniform_float64"],
            "sequential_over_gumbel": ms["distinct_sequential"] / ms["distinct_gumbel"],
        },
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
