"""What a CUDA graph replay costs on this machine, empty and with many kernels (issue 46).

    python3 benchmarks/gpu/gpu_graph_replay.py [--out replay.json]

Two graphs per iteration is the plan only if a replay is cheap where the product runs: a plain
launch costs a few microseconds of host time on bare metal, but the lent machines are VMs, and
a profile on the H100 showed 1-2 ms per `cudaGraphLaunch` (under the profiler). This measures,
unprofiled, the host time of `graph.replay()` (returning before the device finishes) and the
wall time of replay plus synchronisation, for a graph of 1 kernel and of `--kernels` small
kernels (the size of an engine side run eagerly), against the same kernels launched eagerly.
Medians over `--repeats` replays. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def kernels(x: torch.Tensor, count: int) -> None:
    for _ in range(count):
        x.add_(1.0)


def timed(fn, repeats: int) -> dict[str, float]:  # noqa: ANN001 (a callable of nothing)
    """Median host microseconds of `fn` and of `fn` + synchronize."""
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        host.append(issued - start)
        wall.append(end - start)
    return {
        "host_us": round(1e6 * statistics.median(host), 2),
        "wall_us": round(1e6 * statistics.median(wall), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    x = torch.zeros(1024, device="cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    stream = torch.cuda.Stream()
    for count in (1, args.kernels):
        kernels(x, count)  # warm up the kernel before capture
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                kernels(x, count)
        torch.cuda.current_stream().wait_stream(stream)
        report[f"graph_{count}"] = timed(graph.replay, args.repeats)
        report[f"eager_{count}"] = timed(lambda c=count: kernels(x, c), max(args.repeats // 10, 5))
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
