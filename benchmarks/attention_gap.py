"""Why a seeded request's tokens depend on its batch mates in bfloat16 (issue 21's open target).

A batched forward stacks the sessions' KV caches column-aligned (dsbd_core/models/kv_cache.py):
a session with fewer cached columns than the widest gets masked padding columns *between* its
cached keys and the forest nodes fed after them, and the gap's width depends on the batch
mates. Measured here on one thread: a bfloat16 `Linear` row is bit-identical in batches of 1 to
512 rows, SDPA is bit-identical with masked padding *after* the keys (any length) and with
other sequences in the batch, and the SmolLM2 target's right-padded prefill equals the lone
one. A masked gap in the middle is not: the query's output changes in its last bits for most
gap widths (1, 3, 8, 10 in both dtypes), while widths that are multiples of the 16-lane vector
width left it equal in both (the keys after the gap change lanes in the vectorised softmax and
value reductions). This script prints, per dtype, whether SDPA over keys with a
masked gap of each width equals SDPA over the same keys without it.

    .venv/bin/python benchmarks/attention_gap.py     # writes benchmarks/results/attention_gap.json

A fix keeps each session's keys contiguous (nodes written right after its own cached columns,
padding only at the end), which needs a cache that writes rows at their own offsets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def gap_equal(dtype: torch.dtype, gaps: list[int], heads: int = 9, dim: int = 64,
              queries: int = 3, before: int = 30, after: int = 6) -> dict[int, float]:  # fmt: skip
    """Per gap width: the largest difference between attention with and without the gap."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = randn(1, heads, queries, dim), randn(1, heads, before + after, dim), randn(
        1, heads, before + after, dim)  # fmt: skip
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


def linear_rows_equal(rows: list[int], features: int = 576, out: int = 1536) -> bool:
    """Whether one bfloat16 row through a Linear is bit-identical alone and at every position
    of batches of `rows` rows (it is: the matmuls are not where batch invariance is lost)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(features, out).to(torch.bfloat16)
    row = torch.randn(1, features, generator=generator).to(torch.bfloat16)
    alone = linear(row)[0]
    for count in rows:
        for position in sorted({0, count // 2, count - 1}):
            batch = torch.randn(count, features, generator=generator).to(torch.bfloat16)
            batch[position] = row[0]
            if not torch.equal(linear(batch)[position], alone):
                return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/attention_gap.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    gaps = [0, 1, 3, 8, 10, 15, 16, 29, 32, 48]
    by_dtype = {str(dtype).removeprefix("torch."): gap_equal(dtype, gaps)
                for dtype in (torch.bfloat16, torch.float32)}  # fmt: skip
    rows = [1, 2, 3, 8, 16, 17, 33, 64, 128, 512]
    with torch.inference_mode():
        linear_equal = linear_rows_equal(rows)
    results = {
        "torch": torch.__version__,
        "threads": 1,
        "max_abs_difference_by_gap": by_dtype,
        "bf16_linear_row_equal_in_batches_of": {"rows": rows, "equal": linear_equal},
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for dtype, by_gap in results["max_abs_difference_by_gap"].items():
        print(dtype, "attention:", " ".join(f"gap {g}: {'equal' if d == 0 else f'{d:.2g}'}"
                              for g, d in by_gap.items()))  # fmt: skip
    print(f"bfloat16 Linear row alone vs in batches of {rows} rows: equal={linear_equal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
