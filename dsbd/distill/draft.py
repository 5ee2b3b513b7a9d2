"""The draft's construction from the target (`make_draft`) for its architecture (`DraftSpec`,
in `config`).

- `cut`: the target's first `layers` decoder layers, final norm and (frozen, shared) embedding /
  head, then trained. Starts from the target's own features and its exact output space.
- `small`: a fresh narrow Llama (`hidden`, `layers`) with tied embeddings initialised from the
  top singular directions of the target's embedding matrix.
"""

from __future__ import annotations

import torch

from dsbd.acceptance import model_device
from dsbd.distill.config import DraftSpec  # torch-free: the CLI's parser reads its defaults


def make_draft(target_model, spec: DraftSpec, seed: int):
    """A fresh draft for `target_model` (not modified) with `requires_grad` set for training."""
    import copy

    from dsbd_core.models import keep_first_layers

    if spec.arch == "cut":
        draft = keep_first_layers(copy.deepcopy(target_model), spec.layers)
        # The tied embedding/head stays the target's: frozen (and never stored in a delta).
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)
    else:
        draft = _small_draft(target_model, spec, seed)
    draft.config.use_cache = True
    return draft.train()


def _small_draft(target_model, spec: DraftSpec, seed: int):
    """A fresh narrow Llama-like draft in the target's config family, its tied embedding set to
    the target embedding's top `hidden` singular directions (scaled by the singular values)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target_model.config)
    heads = max(1, spec.hidden // 64)
    config.hidden_size = spec.hidden
    config.num_hidden_layers = spec.layers
    config.num_attention_heads = heads
    config.num_key_value_heads = heads
    config.head_dim = spec.hidden // heads
    config.intermediate_size = spec.intermediate or 64 * round(spec.hidden * 2.7 / 64)
    config.tie_word_embeddings = True
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: spec.layers]
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Initialised on the CPU (the SVD too), so the draft starts the same on every device.
    embedding = target_model.get_input_embeddings().weight.detach().float().cpu()
    u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(u[:, : spec.hidden] * s[: spec.hidden])
    draft.tie_weights()
    draft.to(model_device(target_model))
    return draft


def trainable_state(model) -> dict[str, torch.Tensor]:
    """A copy of the parameters that training updates (the frozen embedding/head excluded)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
