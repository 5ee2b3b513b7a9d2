"""Tiny real models for serving tests: a byte-level BPE tokenizer with a chat template, and a
target/draft pair of 2-layer Llamas saved as ordinary transformers directories.

Everything is built in the test (seconds, no download): the serving stack loads them exactly
as it loads SmolLM2 (`load_causal_lm` on a directory), so HTTP, tokenization, chat templates,
stop tokens and the KV-cache paths are the real ones. The draft is the target with a little
noise on its weights, so acceptance is high but not 1.

The in-process tests' models are built here too: `tiny_model` (TINY_SHAPE, any vocabulary),
`tiny` (the engine tests' float64 model of VOCAB tokens), `random_llama` and `noisy_copy` (the
beam-search tests' float64 target and draft), and `save_tiny_model` (a tiny Llama with the
word-level tokenizer of `tiny_tokens`, saved as a directory).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tok_decoders
from tokenizers.models import WordLevel
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Beam search keeps the best sequences; speculative decoding drafts and verifies.",
    "one two three four five six seven eight nine ten",
]


def build_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tok_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


# The tests' small model: attention (grouped KV heads) and an MLP like the real ones, and a
# forward of microseconds, so exactness runs take 1e5 decodes.
TINY_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_model(
    vocab_size: int,
    *,
    arch: str = "llama",
    seed: int | None = None,
    positions: int = 128,
    **overrides: object,
) -> PreTrainedModel:
    """A randomly initialised model of TINY_SHAPE in eval mode (float32); `seed` seeds torch
    first (None: the caller's generator state draws the weights)."""
    if seed is not None:
        torch.manual_seed(seed)
    config_class, model_class = ARCHS[arch]
    config = config_class(
        vocab_size=vocab_size, max_position_embeddings=positions, **{**TINY_SHAPE, **overrides}
    )
    return model_class(config).eval()


def _pair_folders(root: Path) -> tuple[Path, Path, int, dict[str, int]]:
    """`root/target` and `root/draft`, each with the tests' tokenizer: their paths, the
    vocabulary size and the special token ids a model of the pair is built with."""
    target_dir, draft_dir = root / "target", root / "draft"
    for path in (target_dir, draft_dir):
        path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(target_dir)
    tokenizer.save_pretrained(draft_dir)
    special = {
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    return target_dir, draft_dir, len(tokenizer), special


def _save(model: PreTrainedModel, path: Path, eos_token_id: int) -> None:
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id)
    model.save_pretrained(path)


def build_pair(root: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """Write `root/target` and `root/draft` (same tokenizer); returns their paths."""
    target_dir, draft_dir, vocab, special = _pair_folders(root)
    target = tiny_model(vocab, seed=seed, positions=256, **special)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peakier than the default init: beams differ
    _save(target, target_dir, special["eos_token_id"])
    draft = tiny_model(vocab, positions=256, **special)
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter) * parameter.std())
    _save(draft, draft_dir, special["eos_token_id"])
    return target_dir, draft_dir


def build_identity_pair(root: Path, *, extra_layers: int = 30, seed: int = 0) -> tuple[Path, Path]:
    """Write `root/target` and `root/draft` whose next-token distributions are equal bit for bit
    while the target costs many times the draft: the target is the draft plus `extra_layers`
    decoder layers whose output projections (attention's o_proj, the MLP's down_proj) are zero,
    so each adds exactly 0 to the residual stream. Every drafted token passes, and drafting
    pays: a pair on which the cost model must draft (tests of the adaptive path)."""
    target_dir, draft_dir, vocab, special = _pair_folders(root)
    draft = tiny_model(vocab, seed=seed, positions=256, **special)
    with torch.no_grad():
        draft.lm_head.weight.mul_(4.0)  # peakier than the default init, as build_pair's
    _save(draft, draft_dir, special["eos_token_id"])
    layers = TINY_SHAPE["num_hidden_layers"] + extra_layers
    target = tiny_model(vocab, positions=256, num_hidden_layers=layers, **special)
    missing, unexpected = target.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all(".layers." in name for name in missing)
    with torch.no_grad():
        for layer in target.model.layers[TINY_SHAPE["num_hidden_layers"] :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    _save(target, target_dir, special["eos_token_id"])
    return target_dir, draft_dir


# The engine tests' model (`tiny`): VOCAB tokens.
VOCAB = 16


def tiny(arch: str, seed: int) -> torch.nn.Module:
    """A TINY_SHAPE model of VOCAB tokens in float64 (sdpa), its head sharpened."""
    model = tiny_model(VOCAB, arch=arch, seed=seed, attn_implementation="sdpa").to(torch.float64)
    with torch.no_grad():  # sharper distributions than the default init, so beams differ
        model.lm_head.weight.mul_(8.0)
    return model


def random_llama(seed: int, vocab: int = 24, eos_boost: float = 0.0) -> torch.nn.Module:
    """A random 2-layer float64 Llama; `eos_boost` makes token 0 (the EOS here) likelier."""
    model = tiny_model(vocab, seed=seed).to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        model.lm_head.weight[0] += eos_boost * model.lm_head.weight[0].sign()
    return model


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 9) -> torch.nn.Module:
    """A float64 copy of a Llama with noise of `scale` times each weight's spread: a draft."""
    torch.manual_seed(seed)
    copy = LlamaForCausalLM(model.config).to(torch.float64).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(scale * torch.randn_like(parameter) * parameter.std())
    return copy


def tiny_tokens(size: int) -> list[str]:
    """`<unk>`, `</s>` and words `w0 w1 ...`: `size` tokens in all."""
    return ["<unk>", "</s>"] + [f"w{i}" for i in range(size - 2)]


def save_tiny_model(path: Path, tokens: list[str], *, layers: int = 2, seed: int = 0) -> Path:
    """Save a random tiny Llama (logits size = len(tokens)) and its word-level tokenizer."""
    backend = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# A model whose KV cache is large per token (16 layers x 2 heads x 64 x 2 x 8 bytes = 32 KiB in
# float64) and whose activations are small: memory is dominated by the sessions' caches, as with
# long prompts on a real model (tests/serving/test_faults.py's admission test).
WIDE = {
    "num_hidden_layers": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "hidden_size": 128,
    "intermediate_size": 128,
}


def build_wide(root: Path) -> Path:
    """`WIDE` with the tiny pair's tokenizer, saved under `root`."""
    tokenizer = build_tokenizer(root)
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        **WIDE,
    )
    LlamaForCausalLM(config).eval().save_pretrained(root)
    return root
