"""The trained draft as a standard transformers directory, from a run or from its checkpoint."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from dsbd.distill.checkpoint import read_checkpoint
from dsbd.distill.draft import DraftSpec, make_draft


def export_checkpoint(target, run_dir: Path, out_dir: Path) -> dict:
    """Write the draft of a run's latest checkpoint (`run_dir/state.pt`) to `out_dir`, without
    training: a snapshot of a run still going. Returns the checkpoint's step and last held-out
    figures."""
    state = read_checkpoint(run_dir / "state.pt")
    spec = DraftSpec(**state["settings"]["spec"])
    draft = make_draft(target.model, spec, state["settings"]["train"]["seed"])
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.requires_grad:
                param.copy_(state["trainable"][name])
    save_draft(draft, target.tokenizer, out_dir)
    last = state["history"][-1] if state["history"] else {}
    return {"step": state["step"], "elapsed_s": state["elapsed_s"], "last_eval": last}


def save_draft(draft, tokenizer, out_dir: Path) -> None:
    """Write the draft as a standard transformers directory (config, safetensors, tokenizer)."""
    import copy

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model = copy.deepcopy(draft).eval().cpu()
        for param in model.parameters():
            param.requires_grad_(False)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
