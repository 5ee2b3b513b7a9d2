"""Tokens in and out of a loaded model: its tokenizer, the ids that end a reply, prompts.

Apart from the loader because the router needs a tokenizer and its stop ids without loading
any weights (`load_tokenizer`).
"""

from __future__ import annotations

from typing import cast

from transformers import AutoTokenizer, GenerationConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dsbd_core.models.errors import ModelSourceError
from dsbd_core.models.loading import LoadedModel, hub_offline, resolve_source

# End-of-turn markers of common chat templates: a chat reply ends with one of these even when the
# tokenizer's `eos_token` is the end-of-document token (or the other way round).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def load_tokenizer(source: str) -> tuple[PreTrainedTokenizerBase, tuple[int, ...]]:
    """The tokenizer of `source` and its stop ids, without loading the weights (the router)."""
    resolved = resolve_source(source)
    offline = hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, local_files_only=offline)
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot load the tokenizer of {source!r}: {error}") from error
    try:
        eos = GenerationConfig.from_pretrained(resolved, local_files_only=offline).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos only
        eos = None
    return tokenizer, _stop_ids(tokenizer, eos)


def stop_token_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """Ids that end a reply: eos of tokenizer and generation config, plus end-of-turn markers."""
    return _stop_ids(loaded.tokenizer, loaded.model.generation_config.eos_token_id)


def _stop_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list | None) -> tuple:
    """Union of both eos settings and the end-of-turn markers the tokenizer knows as special."""
    ids: set[int] = set()
    for eos in (tokenizer.eos_token_id, generation_eos):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    special = set(tokenizer.all_special_tokens)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in special and t in vocab)
    return tuple(sorted(ids))


def has_chat_template(loaded: LoadedModel) -> bool:
    """True when the tokenizer knows how to format a chat (instruction-tuned models)."""
    return bool(getattr(loaded.tokenizer, "chat_template", None))


def encode_prompt(loaded: LoadedModel, text: str, *, chat: bool | None = None) -> list[int]:
    """Token ids of `text`; as one user turn of the chat template when `chat` (default: if any)."""
    use_chat = has_chat_template(loaded) if chat is None else chat
    if use_chat:
        if not has_chat_template(loaded):
            raise ModelSourceError(f"{loaded.name!r} has no chat template; use --no-chat")
        text = cast(  # tokenize=False: the templated text
            str,
            loaded.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
        )
        return loaded.tokenizer.encode(text, add_special_tokens=False)
    return loaded.tokenizer.encode(text)
