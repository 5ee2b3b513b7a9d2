"""Does a seeded decode's output depend on the requests it shares forwards with?

Decodes the seeded DSBD requests of PROMPTS together (`dsbd_core.algorithm.drivers.lockstep`: each
its own seed and random streams, one shared draft and one shared target forward per round, as
the serving replicas batch them) and each alone with `generate`, for `--rounds` rounds of seeds
and every numerics variant of `--variants` (dtype x draft quantisation), and counts the
requests whose beams are token-identical. Random
draws are seeded per (seed, iteration, side), so any difference comes from the probabilities:
bfloat16 rounding that changes with the batch's shape, or the int8 draft's activation scale
taken over the whole batch. docs/SERVING.md "Seeded decodes and numerics" quotes the result.

    # SmolLM2 pair, 4 variants; writes results/batch_invariance.json beside this file
    .venv/bin/python benchmarks/investigations/batch_invariance/batch_invariance.py
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import torch

from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.models import load_tokenizer
from dsbd_core.models.pair import DraftOptions, load_pair
from dsbd_core.models.transformer_scorer import TransformerScorer

PROMPTS = [
    [163, 176, 189, 202],
    [44, 57, 70, 83, 96, 109, 122],
    [72, 85, 98, 111, 124, 137],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
]
VARIANTS = ("float32:none", "bfloat16:none", "float32:int8", "bfloat16:int8")


def equal_alone(dtype: str, quantize: str, rounds: int, max_new_tokens: int) -> dict:
    """How many of the batched requests decoded exactly what they decode alone."""
    pair = load_pair(
        DEFAULT_TARGET, DEFAULT_DRAFT, dtype=dtype, draft_options=DraftOptions(quantize=quantize)
    )
    assert pair.draft is not None
    _, stop = load_tokenizer(DEFAULT_TARGET)
    same = total = 0
    for round_ in range(rounds):
        requests = [
            Request(
                p,
                SamplingConfig(
                    eos_token_ids=stop,
                    seed=10 * round_ + i,
                    max_new_tokens=max_new_tokens,
                    width=3 - i % 2,
                    gamma=2,
                ),
            )
            for i, p in enumerate(PROMPTS)
        ]
        target = SessionBatcher(TransformerScorer(pair.target.model))
        draft = SessionBatcher(TransformerScorer(pair.draft.model))
        together, _ = decode_lockstep(requests, target, draft)
        for request, batched in zip(requests, together, strict=True):
            alone = generate(
                "dsbd",
                TransformerScorer(pair.target.model),
                request.prompt_ids,
                request.config,
                draft=TransformerScorer(pair.draft.model),
            )
            assert batched.result is not None, batched.error
            total += 1
            tokens = [b.token_ids for b in batched.result.beams]
            same += [b.token_ids for b in alone.beams] == tokens
    return {"models": pair.describe(), "equal": same, "compared": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="DTYPE:QUANTIZE list")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "batch_invariance.json",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "prompts": len(PROMPTS),
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
        "variants": {},
    }
    for variant in args.variants.split(","):
        dtype, quantize = variant.split(":")
        results["variants"][variant] = found = equal_alone(
            dtype, quantize, args.rounds, args.max_new_tokens
        )
        print(
            f"{variant}: {found['equal']}/{found['compared']} equal alone and batched "
            f"({found['models']})",
            flush=True,
        )
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
