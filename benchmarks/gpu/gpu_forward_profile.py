"""Where a target call's time goes on a GPU: our scorer's beam step against a bare forward.

benchmarks/gpu/gpu_costs.py timed a beam step of the Qwen2.5-Coder-1.5B shape at ~67 ms on an H100
and of a 7B at 62-104 ms, where reading a 1.5B model's weights takes about a millisecond: the
time is the host's, not the GPU's. This script tells the scorer's own work from transformers'
forward on the same random-weight model, cache and rows:

  bare   `model(input_ids, past_key_values=cache)` on W rows x 1 token after a prefill of
         `--context` tokens (what any engine pays per step, launch-bound on a small model);
  beam   one beam-sampling step through the decode loop and `TransformerScorer`
         (gpu_costs_engine.time_beam: masks, position ids, KV compaction, the engine's draws);
  then `torch.profiler` over steady-state iterations (two profiled decodes differenced, so the
  prefill drops out): the top ops per iteration by host (self CPU) time and by device time, and
  the launch calls per iteration (kernels, or graph replays on the static path). `--gamma N`
  profiles DSBD iterations of depth N (the size's draft, its gamma draft calls and the verify)
  instead of beam steps.

    python3 benchmarks/gpu/gpu_forward_profile.py --size qwen          # GPU
    .venv/bin/python benchmarks/gpu/gpu_forward_profile.py --size tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from dsbd_core.models.dtypes import DTYPES

try:  # `python benchmarks/gpu/gpu_forward_profile.py`: benchmarks/gpu/ is on sys.path
    from gpu_costs_engine import time_beam, time_dsbd
    from gpu_costs_models import SIZES, build_model
    from gpu_costs_timing import Bench, synchronize
except ModuleNotFoundError:  # imported from the repository root
    from benchmarks.gpu.gpu_costs_engine import time_beam, time_dsbd
    from benchmarks.gpu.gpu_costs_models import SIZES, build_model
    from benchmarks.gpu.gpu_costs_timing import Bench, synchronize


STEADY = 10  # profiled steady-state iterations
# Host-side launch calls: one per kernel, or one per replayed CUDA graph.
LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
)


def bare_step_ms(model, device: torch.device, width: int, context: int, repeats: int) -> float:
    """Median ms of transformers' own forward of W rows x 1 token over a `context`-token cache."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (width, context), device=device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(prompt, past_key_values=cache, use_cache=True)
        token = torch.randint(0, vocab, (width, 1), device=device)
        times = []
        for _ in range(repeats + 2):
            synchronize(device)
            start = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            synchronize(device)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def profiled_ops(run: Callable[[int], object], device: torch.device) -> dict[str, list[float]]:
    """Per-iteration figures of steady-state iterations: op -> [calls, self host us, self device
    us], from two profiled decodes (1 and 1 + STEADY iterations after the prefill) differenced,
    so the one-off prefill (an eager forward: ~1,000 launches) drops out."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    totals = []
    for repeats in (1, 1 + STEADY):
        with profile(activities=activities) as prof:
            run(repeats)
        totals.append(
            {
                e.key: (e.count, e.self_cpu_time_total, getattr(e, "self_device_time_total", 0.0))
                for e in prof.key_averages()
            }
        )
    short, long = totals
    return {
        key: [(n - short.get(key, (0, 0, 0))[i]) / STEADY for i, n in enumerate(values)]
        for key, values in long.items()
    }


def top(ops: dict[str, list[float]], column: int, rows: int) -> list[dict]:
    """The `rows` ops with the most time in `column` (1: host, 2: device), per iteration."""
    ranked = sorted(ops.items(), key=lambda item: -item[1][column])[:rows]
    return [
        {
            "op": key[:90],
            "calls": round(v[0], 1),
            "host_us": round(v[1], 1),
            "device_us": round(v[2], 1),
        }
        for key, v in ranked
        if v[column] > 0
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="qwen")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument(
        "--gamma",
        type=int,
        default=0,
        help="0: profile beam steps; > 0: DSBD iterations of this depth",
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--decode-path",
        choices=("dynamic", "static"),
        default="dynamic",
        help="the scorers' path (static: captured buckets)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON of the figures and tables")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    target = build_model(SIZES[args.size]["target"], device, dtype)
    draft = build_model(SIZES[args.size]["draft"], device, dtype) if args.gamma else target
    bench = Bench(target, draft, device, 2, args.repeats, None, 0, args.decode_path)
    # a pool long enough for every decode here (the profiled ones too): no regrowth, no recapture
    iterations = max(args.repeats, 1 + STEADY) + 4
    bench.capture(rows=args.width, length=args.context + iterations * (args.gamma + 1) + 8)
    bare = bare_step_ms(target, device, args.width, args.context, args.repeats)
    if args.gamma:
        cost = time_dsbd(bench, args.context, args.width, args.gamma)
        timed = {
            "draft_iteration_ms": cost.draft_iteration_ms,
            "verify_ms": cost.verify_ms,
            "host_ms": cost.host_ms,
        }
    else:
        beam = time_beam(bench, args.context, args.width)
        timed = {"beam_step_ms": beam.beam_step_ms, "host_ms": beam.host_ms}
    print(
        f"{args.size} on {device} ({args.dtype}, {args.decode_path} path, {args.threads} "
        f"threads), W = {args.width}, gamma = {args.gamma}, context {args.context}: bare "
        f"forward {bare:.2f} ms, {timed}"
    )

    def run(repeats: int) -> None:  # the same scorers (pool, captured buckets)
        profiled = Bench(
            target, draft, device, 1, repeats, None, 0, args.decode_path, scorers=bench.scorers
        )
        if args.gamma:
            time_dsbd(profiled, args.context, args.width, args.gamma)
        else:
            time_beam(profiled, args.context, args.width)

    ops = profiled_ops(run, device)
    launches = {key: round(ops[key][0], 1) for key in LAUNCHES if key in ops}
    by_host, by_device = top(ops, 1, 25), top(ops, 2, 15)
    host_total = sum(v[1] for v in ops.values()) / 1000
    device_total = sum(v[2] for v in ops.values()) / 1000
    print(
        f"per iteration ({STEADY} steady-state iterations): launch calls {launches}, self host "
        f"{host_total:.2f} ms, self device {device_total:.2f} ms"
    )
    for title, rows in (("by host time", by_host), ("by device time", by_device)):
        print(f"top ops {title} (per iteration):")
        for row in rows:
            print(
                f"  {row['host_us']:>9.1f} us host {row['device_us']:>9.1f} us device "
                f"{row['calls']:>7.1f} calls  {row['op']}"
            )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "size": args.size,
                    "device": str(device),
                    "dtype": args.dtype,
                    "width": args.width,
                    "gamma": args.gamma,
                    "context": args.context,
                    "threads": args.threads,
                    "decode_path": args.decode_path,
                    "bare_forward_ms": bare,
                    **timed,
                    "beam_step_ms": timed.get("beam_step_ms"),
                    "beam_host_ms": timed["host_ms"],
                    "launches_per_step": launches,
                    "self_host_ms_per_iteration": host_total,
                    "self_device_ms_per_iteration": device_total,
                    "by_host": by_host,
                    "by_device": by_device,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
