"""Ship a distilled SmolLM2 draft in the repository: a delta against the embedded target.

    .venv/bin/python scripts/ship_draft.py --draft ~/.cache/dsbd/distill/smollm2/draft \\
        --run ~/.cache/dsbd/distill/smollm2/run

A `cut` draft shares its (frozen, tied) embedding with the target, so only its own tensors are
stored, in float16 (`dsbd_core.models.write_delta`), under
`dsbd_core/models/drafts/smollm2-distilled/` with `training.json` (settings, step, training time,
held-out figures). The `smollm2-distilled` preset rebuilds a standard transformers directory from it
and the target (once, into the cache). The rebuilt draft is checked against the original (same
logits up to float16 round-off).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from dsbd_core.models import (
    DISTILLED_PRESET,
    SHIPPED_DRAFTS,
    build_from_delta,
    load_causal_lm,
    prepare_preset,
    write_delta,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="the distilled draft directory")
    parser.add_argument("--run", type=Path, help="its run directory (state.pt: training record)")
    parser.add_argument("--out", type=Path, default=SHIPPED_DRAFTS / DISTILLED_PRESET)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target_dir = prepare_preset("smollm2")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ship-", dir=args.out.parent))
    try:
        description = write_delta(args.draft.expanduser(), target_dir, tmp / "delta")
        build_from_delta(tmp / "delta", target_dir, tmp / "rebuilt")
        original = load_causal_lm(str(args.draft.expanduser())).model
        rebuilt = load_causal_lm(str(tmp / "rebuilt")).model
        ids = torch.arange(1000, 1064)[None]
        with torch.no_grad():
            p = torch.softmax(original(ids).logits, -1)
            q = torch.softmax(rebuilt(ids).logits, -1)
        tv = 0.5 * (p - q).abs().sum(-1).max().item()
        print(f"rebuilt from the float16 delta: max total variation to the original {tv:.2e}")
        assert tv < 1e-2, "the float16 delta changes the draft too much"
        record = {"delta": {k: description[k] for k in ("dtype", "parameters_stored")}}
        if args.run:
            state = torch.load(args.run.expanduser() / "state.pt", weights_only=False)
            record |= {
                "settings": state["settings"],
                "step": state["step"],
                "train_hours": state["elapsed_s"] / 3600,
                "heldout_history": state["history"],
            }
        (tmp / "delta" / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        if args.out.exists():
            shutil.rmtree(args.out)
        (tmp / "delta").rename(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
