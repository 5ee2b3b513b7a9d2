"""The device's forest layout against the host's on the embedded pair: same tokens?

`dsbd_core/models/slot_layout.py` lays a forest out on the model's device (every layer's slots
in every tree row); the host keeps the packed layout. On the CPU, `computing_everywhere()` makes
the engine and the static scorer take the device's branches, so both layouts decode the same
prompts with the same seed here. Not a timing (another job may run beside it).

    .venv/bin/python benchmarks/investigations/host_reads/slot_layout_check.py \\
        [--dtype float32|float64] [--tokens 24]
        [--methods dsbd-fixed,dsbd-dynamic,spec_beam_search,sps,beam]

Prints, per method, whether each prompt's beams are the same tokens and the largest difference
of a beam's log-likelihood. float64 loads the draft unquantised (int8 is never used there).
"""

from __future__ import annotations

import argparse

from dsbd_core import generate_batch
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.models.pair import load_pair

METHODS = {
    "dsbd-fixed": ("dsbd", {"width": 3, "gamma": 3, "threshold": None}),
    "dsbd-dynamic": ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
    "spec_beam_search": ("spec_beam_search", {"width": 3, "gamma": 3}),
    "sps": ("sps", {"gamma": 3}),
    "beam": ("beam", {"width": 3}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names")
    args = parser.parse_args()
    pair = load_pair("smollm2", "smollm2-draft", dtype=args.dtype, decode_path="static")
    print(pair.describe())
    prompts = [
        pair.encode("Write a haiku about the sea.", chat=True),
        pair.encode("def fibonacci(n):", chat=False),
    ]
    for name in args.methods.split(","):
        method, fields = METHODS[name]
        config = pair.sampling_config(args.tokens, seed=args.seed).model_copy(update=fields)
        target, draft = pair.scorers()
        host = generate_batch(method, target, prompts, config, draft)
        target, draft = pair.scorers()
        with computing_everywhere():
            device = generate_batch(method, target, prompts, config, draft)
        same = [
            [b.token_ids for b in a.beams] == [b.token_ids for b in c.beams]
            for a, c in zip(host, device, strict=True)
        ]
        gap = max(
            abs(x.log_likelihood - y.log_likelihood)
            for a, c in zip(host, device, strict=True)
            for x, y in zip(a.beams, c.beams, strict=False)
        )
        print(f"{name}: same tokens per prompt {same}, max |dLL| {gap:.2e}")


if __name__ == "__main__":
    main()
