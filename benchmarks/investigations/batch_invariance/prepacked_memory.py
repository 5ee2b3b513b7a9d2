"""What oneDNN's prepacked linear weights cost in memory: RSS with and without them.

`RowChunkedLinear` (dsbd_core/models/row_chunks.py) reorders each bfloat16 weight once into
oneDNN's blocked layout and keeps it beside the plain weight (which still serves the tied
embedding, autograd and non-CPU devices). This loads the SmolLM2 pair in bfloat16 in a fresh
process per setting, runs one batched forward on each model and reports the process's RSS
before and after, with the prepacked path on and off.

    .venv/bin/python benchmarks/investigations/batch_invariance/prepacked_memory.py
    # writes benchmarks/investigations/batch_invariance/results/prepacked_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from dsbd.common import DEFAULT_DRAFT, DEFAULT_TARGET
from dsbd_core.algorithm.scorer import ForestLayer, Roots
from dsbd_core.models.pair import DraftOptions, load_pair
from dsbd_core.models import row_chunks
from dsbd_core.models.transformer_scorer import TransformerScorer
if sys.argv[1] == "off":
    row_chunks.RowChunkedLinear._packed_weight = lambda self: None
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
pair = load_pair(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="bfloat16",
                 draft_options=DraftOptions(quantize="none"))
weights = sum(p.numel() * p.element_size() for m in (pair.target.model, pair.draft.model)
              for p in m.parameters()) / 2**20
before = rss()
tokens = torch.arange(100, 140).view(2, 1, 20).expand(2, 3, 20).contiguous()
roots = Roots(tokens, torch.tensor([20, 20]), torch.ones(2, 3, dtype=torch.bool), None)
layer = ForestLayer(torch.tensor([[0, 1, 2, 0]] * 2), torch.tensor([[5, 6, 7, 8]] * 2),
                    torch.ones(2, 4, dtype=torch.bool))
for model in (pair.target.model, pair.draft.model):
    scorer = TransformerScorer(model)
    scorer.set_roots(roots)
    scorer.forward([layer])
print(json.dumps({"rss_before_mib": before, "rss_after_mib": rss(), "weights_mib": weights}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "prepacked_memory.json",
    )
    args = parser.parse_args()
    found = {}
    for setting in ("off", "on"):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, setting],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        found[setting] = json.loads(done.stdout.strip().splitlines()[-1])
        print(setting, found[setting], flush=True)
    found["prepacked_extra_mib"] = found["on"]["rss_after_mib"] - found["off"]["rss_after_mib"]
    args.out.write_text(json.dumps(found, indent=1) + "\n")
    print(
        f"prepacked weights: +{found['prepacked_extra_mib']:.0f} MiB RSS "
        f"(bfloat16 weights: {found['on']['weights_mib']:.0f} MiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
