"""Why a seeded request's tokens depended on its batch mates in bfloat16 (issue 21), and the fix.

A batched forward used to stack the sessions' KV caches column-aligned: a session with fewer
cached columns than the widest got masked padding columns *between* its cached keys and the
forest nodes fed after them, whose width depends on the batch mates. Measured here on one
thread: SDPA is bit-identical with masked padding *after* the keys (any length) and with other
sequences in the batch, and the SmolLM2 target's right-padded prefill equals the lone one. A
masked gap in the middle is not: the query's output changes in its last bits for most gap
widths (1, 3, 8, 10 in both dtypes; multiples of the 16-lane vector width left it equal). The
second cause is the matmuls: every row of a bfloat16 `Linear` call equals the row computed
alone for 1 to 32 rows per call, not from 33 on (another kernel). This script prints both.

    .venv/bin/python benchmarks/investigations/batch_invariance/attention_gap.py
    # writes benchmarks/investigations/batch_invariance/results/attention_gap.json

The fix (dsbd_core/models/packed_forward.py, row_chunks.py): each session attends alone over
its own cache with the shapes of its own forward (no stacking), and a batched forward computes
each session's linear rows in the size class its forward alone uses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def gap_equal(
    dtype: torch.dtype,
    gaps: list[int],
    heads: int = 9,
    dim: int = 64,
    queries: int = 3,
    before: int = 30,
    after: int = 6,
) -> dict[int, float]:
    """Per gap width: the largest difference between attention with and without the gap."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = (
        randn(1, heads, queries, dim),
        randn(1, heads, before + after, dim),
        randn(1, heads, before + after, dim),
    )
    alone = F.scaled_dot_product_attention(q, k, v)
    out = {}
    for gap in gaps:
        keys = torch.cat([k[:, :, :before], randn(1, heads, gap, dim), k[:, :, before:]], 2)
        values = torch.cat([v[:, :, :before], randn(1, heads, gap, dim), v[:, :, before:]], 2)
        mask = torch.ones(1, 1, queries, before + gap + after, dtype=torch.bool)
        mask[..., before : before + gap] = False
        batched = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out[gap] = (batched.float() - alone.float()).abs().max().item()
    return out


def linear_rows_equal(
    rows: list[int], features: int = 576, out: int = 1536, trials: int = 8
) -> dict[int, bool]:
    """Per row count: whether EVERY row of a bfloat16 `Linear` call of that many rows is
    bit-identical to the row computed alone. A single random row (what this checked first)
    hides it: most rows agree and a few elements differ, from 33 rows on, on AMX-BF16
    (`dsbd_core/models/row_chunks.py` keeps batched calls of small sessions at <= 32 rows)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(features, out, bias=False).to(torch.bfloat16)
    batch = (torch.randn(max(rows), features, generator=generator) * 3).to(torch.bfloat16)
    alone = torch.cat([linear(batch[i : i + 1]) for i in range(max(rows))])
    found = {}
    for count in rows:
        starts = range(0, max(rows) - count + 1, max(1, count // trials))
        found[count] = all(
            torch.equal(linear(batch[i : i + count]), alone[i : i + count]) for i in starts
        )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "attention_gap.json",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    gaps = [0, 1, 3, 8, 10, 15, 16, 29, 32, 48]
    by_dtype = {
        str(dtype).removeprefix("torch."): gap_equal(dtype, gaps)
        for dtype in (torch.bfloat16, torch.float32)
    }
    rows = [1, 2, 3, 8, 16, 17, 31, 32, 33, 40, 64, 128, 512]
    with torch.inference_mode():
        linear_equal = linear_rows_equal(rows)
    results = {
        "torch": torch.__version__,
        "threads": 1,
        "max_abs_difference_by_gap": by_dtype,
        "bf16_linear_every_row_equal_alone_by_rows_per_call": linear_equal,
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for dtype, by_gap in results["max_abs_difference_by_gap"].items():
        print(
            dtype,
            "attention:",
            " ".join(f"gap {g}: {'equal' if d == 0 else f'{d:.2g}'}" for g, d in by_gap.items()),
        )
    print(
        "bfloat16 Linear: every row of a call equal to the row alone, by rows per call:",
        linear_equal,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
