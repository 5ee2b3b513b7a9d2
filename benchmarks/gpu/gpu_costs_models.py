"""Random-weight Llama pairs at the paper's sizes, for benchmarks/gpu/gpu_costs.py.

A forward's time depends on shapes, not on weight values, so the timed pair is built from configs
alone: no download, and a 7B target is allocated straight on the device in its dtype.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

# Model shapes. "paper": JackFram/llama-68m (draft) and Llama-2-7B (target), the pair of the
# paper's LLaMA experiments; "qwen": Qwen2.5-Coder-0.5B/1.5B-Instruct (the pair whose acceptance
# benchmarks/results/ holds, so its modelled speedup needs no cost-lopsidedness caveat);
# "tiny": a few-MB pair for CPU smoke runs and tests. `model_type` picks the architecture
# (default llama).
SIZES: dict[str, dict[str, dict]] = {
    "paper": {
        "draft": dict(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=12,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        "target": dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    },
    "qwen": {
        "draft": dict(
            model_type="qwen2",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),
        "target": dict(
            model_type="qwen2",
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),
    },
    "tiny": {
        "draft": dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        "target": dict(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
    },
}
DEFAULT_CONTEXTS = {"paper": (256, 1024), "qwen": (256, 1024), "tiny": (32, 128)}


def model_config(shape: dict) -> PretrainedConfig:
    """The transformers config of `shape`: its `model_type` (default llama) with the rest."""
    options = dict(shape)
    return AutoConfig.for_model(options.pop("model_type", "llama"), **options)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A random-weight model of `shape`, created on `device` in `dtype` directly.

    Allocating on the device (no CPU float32 copy first) keeps a 7B target at seconds instead
    of minutes and at its bf16 size; `sdpa` is one of the two attention implementations that
    honour TransformerScorer's tree mask.
    """
    config = model_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def describe_model(model: PreTrainedModel, shape: dict) -> dict:
    """The config that was built, and its size (what the timings are of)."""
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "architecture": f"{type(model).__name__} (random weights)",
        "config": shape,
        "parameters": parameters,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
