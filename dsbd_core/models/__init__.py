"""The model layer: real models behind the algorithm's `ForestScorer` contract.

Loading (presets, local directories, GGUF files, hub ids) and installing weights, the
transformers scorer with its KV caches, tensor parallelism and draft variants. Imports the
algorithm layer (`dsbd_core.algorithm`) and transformers; never Ray, `deployments` or the CLI.

The names below resolve on first use (PEP 562, `algorithm/lazy_names.py`): a process that
needs only the tokenizer or the presets (Serve's ingress and router) does not pay for importing
transformers' model code, which costs seconds of CPU in each of a server's replicas as they
start together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsbd_core.algorithm.lazy_names import lazy_names

if TYPE_CHECKING:
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
    from dsbd_core.models.tokens import (
        encode_prompt,
        has_chat_template,
        load_tokenizer,
        stop_token_ids,
    )

_EXPORTS = {
    "build_from_delta": "deltas",
    "write_delta": "deltas",
    "ModelSourceError": "errors",
    "VocabularyMismatchError": "errors",
    "assemble_chunks": "install",
    "download_chunks": "install",
    "install_preset": "install",
    "LoadedModel": "loading",
    "check_same_vocabulary": "loading",
    "keep_first_layers": "loading",
    "load_causal_lm": "loading",
    "prepare_preset": "loading",
    "resolve_source": "loading",
    "DEFAULT_DRAFT_LAYERS": "presets",
    "DISTILLED_PRESET": "presets",
    "DRAFT_PRESET": "presets",
    "PRESETS": "presets",
    "QWEN_CODER_DRAFT": "presets",
    "QWEN_CODER_TARGET": "presets",
    "SHIPPED_DRAFTS": "presets",
    "SMOLLM2_GGUF_NAME": "presets",
    "TARGET_PRESET": "presets",
    "ChunkedWeights": "presets",
    "cache_root": "presets",
    "smollm2_gguf_path": "presets",
    "encode_prompt": "tokens",
    "has_chat_template": "tokens",
    "load_tokenizer": "tokens",
    "stop_token_ids": "tokens",
}

__all__ = [
    "DEFAULT_DRAFT_LAYERS",
    "DISTILLED_PRESET",
    "DRAFT_PRESET",
    "PRESETS",
    "QWEN_CODER_DRAFT",
    "QWEN_CODER_TARGET",
    "SHIPPED_DRAFTS",
    "SMOLLM2_GGUF_NAME",
    "TARGET_PRESET",
    "ChunkedWeights",
    "LoadedModel",
    "ModelSourceError",
    "VocabularyMismatchError",
    "assemble_chunks",
    "build_from_delta",
    "cache_root",
    "check_same_vocabulary",
    "download_chunks",
    "encode_prompt",
    "has_chat_template",
    "install_preset",
    "keep_first_layers",
    "load_causal_lm",
    "load_tokenizer",
    "prepare_preset",
    "resolve_source",
    "smollm2_gguf_path",
    "stop_token_ids",
    "write_delta",
]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())
