"""Random-weight Llama pairs at the paper's sizes, for benchmarks/gpu_costs.py.

A forward's time depends on shapes, not on weight values, so the timed pair is built from configs
alone: no download, and a 7B target is allocated straight on the device in its dtype.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

# Model shapes. "paper": JackFram/llama-68m (draft) and Llama-2-7B (target), the pair of the
# paper's LLaMA experiments; "tiny": a few-MB pair for CPU smoke runs and tests.
SIZES: dict[str, dict[str, dict]] = {
    "paper": {
        "draft": dict(
            vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
        ),
        "target": dict(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
        ),
    },
    "tiny": {
        "draft": dict(
            vocab_size=2048, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        "target": dict(
            vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
    },
}  # fmt: skip
DEFAULT_CONTEXTS = {"paper": (256, 1024), "tiny": (32, 128)}


def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A random-weight Llama of `shape`, created on `device` in `dtype` directly.

    Allocating on the device (no CPU float32 copy first) keeps a 7B target at seconds instead
    of minutes and at its bf16 size; `sdpa` is one of the two attention implementations that
    honour TransformerScorer's tree mask.
    """
    config = LlamaConfig(**shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def describe_model(model: PreTrainedModel, shape: dict) -> dict:
    """The config that was built, and its size (what the timings are of)."""
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "architecture": "LlamaForCausalLM (random weights)",
        "config": shape,
        "parameters": parameters,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
