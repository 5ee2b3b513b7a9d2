"""Beam sampling end to end on random weights: ours (static and dynamic path) against transformers.

`dsbd bench --device cuda` times whole decodes on the embedded pair, whose weights (121 MiB) take
three transfers to reach a lent GPU. Beam sampling's cost does not depend on weight values once
every decode runs to the same length, so this script times it at the shapes that matter (the
Qwen2.5-Coder-1.5B target by default) with random weights and no end-of-sequence token, in one
process and with nothing to stage:

  ours-static   `generate("beam", ...)` through the static decode path (captured buckets on CUDA)
  ours-dynamic  the same through the dynamic path (`TransformerScorer`)
  transformers  `model.generate(do_sample=True, num_beams=W, min_new_tokens=N)`

Methods interleave in every round; the first round of each is untimed (captures, allocator
warm-up). Figures: median ms per generated token (N tokens a decode), and each method's time
over ours-static.

    python3 benchmarks/gpu/gpu_e2e_beam.py --size qwen --out e2e.json                 # GPU
    .venv/bin/python benchmarks/gpu/gpu_e2e_beam.py --size tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig

from dsbd_core import SamplingConfig, generate
from dsbd_core.models.decode_path import make_scorer
from dsbd_core.models.dtypes import DTYPES

try:  # `python benchmarks/gpu/gpu_e2e_beam.py`: benchmarks/gpu/ is on sys.path
    from gpu_costs_models import SIZES, build_model
    from gpu_costs_timing import synchronize
except ModuleNotFoundError:  # imported from the repository root
    from benchmarks.gpu.gpu_costs_models import SIZES, build_model
    from benchmarks.gpu.gpu_costs_timing import synchronize


def decoders(model, width: int, tokens: int, prompt: list[int]) -> dict[str, Callable[[int], int]]:
    """Method -> a decode of `tokens` new tokens for a seed, returning how many it made."""
    device = model.device
    ids = torch.tensor([prompt], device=device)

    def ours(path: str) -> Callable[[int], int]:
        scorer = make_scorer(model, path)

        def run(seed: int) -> int:
            config = SamplingConfig(
                width=width,
                gamma=1,
                threshold=None,
                max_new_tokens=tokens,
                seed=seed,
                eos_token_ids=(),
            )
            result = generate("beam", scorer, prompt, config)
            return len(result.best.token_ids)

        return run

    hf_config = GenerationConfig(
        do_sample=True,
        num_beams=width,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        eos_token_id=None,
        pad_token_id=0,
        num_return_sequences=1,
    )

    def transformers_beam(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(ids, generation_config=hf_config)
        synchronize(device)
        return out.shape[1] - ids.shape[1]

    return {
        "ours-static": ours("static"),
        "ours-dynamic": ours("dynamic"),
        "transformers": transformers_beam,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="qwen")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per decode")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (one untimed first)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(SIZES[args.size]["target"], device, DTYPES[args.dtype])
    prompt = torch.randint(1, model.config.vocab_size, (args.context,)).tolist()
    runs = decoders(model, args.width, args.tokens, prompt)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            made = run(round_)
            elapsed = time.perf_counter() - start
            if made != args.tokens:
                raise RuntimeError(f"{name} made {made} tokens, not {args.tokens}")
            if round_:
                seconds[name].append(elapsed)
            print(f"round {round_} {name}: {1000 * elapsed / args.tokens:.2f} ms/token", flush=True)
    ms = {name: 1000 * statistics.median(times) / args.tokens for name, times in seconds.items()}
    report = {
        "what": __doc__.splitlines()[0],
        "size": args.size,
        "device": str(device),
        "dtype": args.dtype,
        "width": args.width,
        "context": args.context,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "ms_per_token": ms,
        "over_ours_static": {name: value / ms["ours-static"] for name, value in ms.items()},
        "seconds": seconds,
    }
    print(json.dumps({k: report[k] for k in ("ms_per_token", "over_ours_static")}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
