"""The model layer: real models behind the algorithm's `ForestScorer` contract.

Loading (presets, local directories, GGUF files, hub ids) and installing weights, the
transformers scorer with its KV caches, tensor parallelism and draft variants. Imports the
algorithm layer (`dsbd_core.algorithm`) and transformers; never Ray, `deployments` or the CLI.
"""

from dsbd_core.models.deltas import build_from_delta, write_delta
from dsbd_core.models.errors import ModelSourceError, VocabularyMismatchError
from dsbd_core.models.install import assemble_chunks, download_chunks, install_preset
from dsbd_core.models.loading import (
    LoadedModel,
    check_same_vocabulary,
    keep_first_layers,
    load_causal_lm,
    prepare_preset,
    resolve_source,
)
from dsbd_core.models.presets import (
    DEFAULT_DRAFT_LAYERS,
    DISTILLED_PRESET,
    DRAFT_PRESET,
    PRESETS,
    QWEN_CODER_DRAFT,
    QWEN_CODER_TARGET,
    SHIPPED_DRAFTS,
    SMOLLM2_GGUF_NAME,
    TARGET_PRESET,
    ChunkedWeights,
    cache_root,
    smollm2_gguf_path,
)
from dsbd_core.models.tokens import encode_prompt, has_chat_template, load_tokenizer, stop_token_ids

__all__ = [
    "DEFAULT_DRAFT_LAYERS", "DISTILLED_PRESET", "DRAFT_PRESET", "PRESETS", "QWEN_CODER_DRAFT",
    "QWEN_CODER_TARGET", "SHIPPED_DRAFTS", "SMOLLM2_GGUF_NAME", "TARGET_PRESET", "ChunkedWeights",
    "LoadedModel", "ModelSourceError", "VocabularyMismatchError", "assemble_chunks",
    "build_from_delta", "cache_root", "check_same_vocabulary", "download_chunks", "encode_prompt",
    "has_chat_template", "install_preset", "keep_first_layers", "load_causal_lm", "load_tokenizer",
    "prepare_preset", "resolve_source", "smollm2_gguf_path", "stop_token_ids", "write_delta",
]  # fmt: skip
