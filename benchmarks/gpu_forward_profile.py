"""Where a target call's time goes on a GPU: our scorer's beam step against a bare forward.

benchmarks/gpu_costs.py timed a beam step of the Qwen2.5-Coder-1.5B shape at ~67 ms on an H100
and of a 7B at 62-104 ms, where reading a 1.5B model's weights takes about a millisecond: the
time is the host's, not the GPU's. This script tells the scorer's own work from transformers'
forward on the same random-weight model, cache and rows:

  bare   `model(input_ids, past_key_values=cache)` on W rows x 1 token after a prefill of
         `--context` tokens (what any engine pays per step, launch-bound on a small model);
  beam   one beam-sampling step through the decode loop and `TransformerScorer`
         (gpu_costs_engine.time_beam: masks, position ids, KV compaction, the engine's draws);
  then a `torch.profiler` table of beam steps by host (self CPU) time and by device time, and
  the launch calls per step (kernels, or graph replays on the static path).

    python3 benchmarks/gpu_forward_profile.py --size qwen          # GPU
    .venv/bin/python benchmarks/gpu_forward_profile.py --size tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from dsbd_core.models.dtypes import DTYPES

try:  # `python benchmarks/gpu_forward_profile.py`: benchmarks/ is on sys.path
    from gpu_costs_engine import time_beam
    from gpu_costs_models import SIZES, build_model
    from gpu_costs_timing import Bench, synchronize
except ModuleNotFoundError:  # imported from the repository root
    from benchmarks.gpu_costs_engine import time_beam
    from benchmarks.gpu_costs_models import SIZES, build_model
    from benchmarks.gpu_costs_timing import Bench, synchronize


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="qwen")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--decode-path",
        choices=("dynamic", "static"),
        default="dynamic",
        help="the scorer's path for the beam step (static: captured buckets)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON of the figures and tables")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    target = build_model(SIZES[args.size]["target"], device, dtype)
    bench = Bench(target, target, device, 2, args.repeats, None, 0, args.decode_path)
    bare = bare_step_ms(target, device, args.width, args.context, args.repeats)
    beam = time_beam(bench, args.context, args.width)
    print(f"{args.size} target on {device} ({args.dtype}), W = {args.width}, context "
          f"{args.context}: bare forward {bare:.2f} ms, our beam step {beam.beam_step_ms:.2f} ms "
          f"(+ host {beam.host_ms:.2f} ms)")  # fmt: skip
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # the same scorer (its pool and captured buckets), 1 untimed + 5 timed steps profiled
    profiled = Bench(target, target, device, 1, 5, None, 0, args.decode_path, bench.scorers)
    with profile(activities=activities) as prof:
        time_beam(profiled, args.context, args.width)
    averages = prof.key_averages()
    launches = {e.key: e.count for e in averages if e.key in LAUNCHES}
    steps = 1 + 5  # time_beam's iterations: the first is the prefill, then 5 beam steps
    print(
        f"launches per step (prefill included): "
        f"{ {key: round(n / steps, 1) for key, n in launches.items()} }"
    )
    by_host = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    device_key = "self_cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    by_device = averages.table(sort_by=device_key, row_limit=15)
    print(by_host)
    print(by_device)
    if args.out:
        args.out.write_text(json.dumps({
            "size": args.size, "device": str(device), "dtype": args.dtype, "width": args.width,
            "context": args.context, "bare_forward_ms": bare, "beam_step_ms": beam.beam_step_ms,
            "beam_host_ms": beam.host_ms, "decode_path": args.decode_path,
            "launches_per_step": {key: n / steps for key, n in launches.items()},
            "by_host": by_host, "by_device": by_device,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
