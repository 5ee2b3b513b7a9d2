"""The bytes each token id adds to a tokenizer's text, for stop strings (algorithm/stops.py).

A stop string is matched on the generated text; the engine matches it on the tokens' bytes
joined, which is the text's UTF-8 wherever the tokenizer's decode is a concatenation of
per-token bytes: byte-level BPE (GPT-2, SmolLM2, Qwen, Llama 3) exactly, SentencePiece pieces
(`▁` as a space, `<0xAB>` byte fallback) up to the space a decode drops at the very start of a
text. Special tokens add nothing (the text is decoded with `skip_special_tokens=True`).

`TokenizerTexts` names a tokenizer by its source, so a stop check that crosses processes
(every iteration call carries one) pickles as a string; each process reads the tokenizer once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_SPIECE_SPACE = "\u2581"


@dataclass(frozen=True)
class TokenizerTexts:
    """The byte table of the tokenizer at `source` (a `TokenTexts`), read once per process."""

    source: str

    def table(self) -> Sequence[bytes]:
        return _source_table(self.source)


@dataclass(frozen=True)
class LoadedTexts:
    """A byte table built in this process (`token_bytes` of a loaded tokenizer): in-process
    decodes, which never pickle their stop check."""

    texts: tuple[bytes, ...]

    def table(self) -> Sequence[bytes]:
        return self.texts


@lru_cache(maxsize=4)
def _source_table(source: str) -> tuple[bytes, ...]:
    from dsbd_core.models.tokens import load_tokenizer

    tokenizer, _ = load_tokenizer(source)
    return token_bytes(tokenizer)


def token_bytes(tokenizer: Any) -> tuple[bytes, ...]:
    """Every token id's bytes in `tokenizer`'s decoded text (b"" for special tokens)."""
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    special = set(tokenizer.all_special_ids)
    byte_level = _byte_decoder() if _is_byte_level(tokenizer) else None
    out = []
    for token_id, piece in enumerate(pieces):
        if token_id in special or piece is None:
            out.append(b"")
        elif token_id in added:
            out.append(tokenizer.decode([token_id], skip_special_tokens=True).encode())
        elif byte_level is not None and all(c in byte_level for c in piece):
            out.append(bytes(byte_level[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))  # SentencePiece byte fallback
        else:
            out.append(piece.replace(_SPIECE_SPACE, " ").encode())
    return tuple(out)


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted (byte-level BPE's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}
