"""Drafts shipped as a delta against their target: only the tensors the draft does not share.

A draft trained from its target keeps some of its tensors (e.g. a frozen tied embedding, the
largest one); shipping only the draft's own tensors keeps the repository small, and the shared
ones are recorded by name and sha256 and read back from the target when the draft is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsbd_core.models.errors import ModelSourceError


def _tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the float32 values: identifies a shared tensor whatever dtype it is stored in."""
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors directory (all shards), without building a model."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    if not tensors:
        raise ModelSourceError(f"{directory}: no .safetensors weights")
    return tensors


def write_delta(draft_dir: Path, base_dir: Path, out: Path, *, dtype=torch.float16) -> dict:
    """Store a draft (transformers dir) as the tensors it does not share with `base_dir`.

    A tensor of the draft equal to the base's tensor of the same name (e.g. the frozen tied
    embedding of a `cut` draft) is recorded by name and sha256 only; every other tensor is
    stored in `dtype`. `build_from_delta` rebuilds a standard transformers directory. Returns
    the delta's description (also written to `out/delta.json`).
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    draft = _read_tensors(Path(draft_dir))
    base = _read_tensors(Path(base_dir))
    shared = {
        name: _tensor_digest(tensor)
        for name, tensor in draft.items()
        if name in base and base[name].shape == tensor.shape and torch.equal(base[name], tensor)
    }
    own = {
        name: tensor.to(dtype).contiguous() for name, tensor in draft.items() if name not in shared
    }
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(draft_dir).save_pretrained(out)
    save_file(own, out / "delta.safetensors")
    description = {
        "shared_with_base": shared,
        "stored": {name: list(t.shape) for name, t in own.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "parameters_stored": sum(t.numel() for t in own.values()),
    }
    (out / "delta.json").write_text(json.dumps(description, indent=2) + "\n")
    return description


def build_from_delta(delta_dir: Path, base_dir: Path, out: Path) -> None:
    """Rebuild the draft of `write_delta` as a float32 transformers directory in `out`.

    The shared tensors are read from `base_dir` and must match the recorded sha256 (a delta
    only fits the base it was made against).
    """
    from safetensors.torch import load_file

    description = json.loads((Path(delta_dir) / "delta.json").read_text())
    base = _read_tensors(Path(base_dir))
    state = {n: t.float() for n, t in load_file(Path(delta_dir) / "delta.safetensors").items()}
    for name, digest in description["shared_with_base"].items():
        if name not in base or _tensor_digest(base[name]) != digest:
            raise ModelSourceError(
                f"{delta_dir}: tensor {name} of the base model {base_dir} is not the one this "
                "draft was trained against"
            )
        state[name] = base[name].float()
    from transformers import AutoConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(delta_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(
            f"{delta_dir}: weights do not fit the config (missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)})"
        )
    model.tie_weights()
    model.float().save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
