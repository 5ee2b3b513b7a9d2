"""How often each token occurs in local text: which K tokens a restricted draft head keeps.

FR-Spec (Zhao et al., ACL 2025) restricts the draft's output layer to the most frequent tokens
of a corpus. No corpus can be downloaded here, so the project builds one from what every
installation has: the installed Python packages' sources (code) and their documentation
(English: package metadata, Markdown, reStructuredText). The files are taken in a fixed order,
round-robin over packages so that no single large package dominates, up to a byte budget; the
counts are computed once per tokenizer and cached (`<cache>/token-frequencies/`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from dsbd_core.models.presets import cache_root

CORPUS_BYTES = 48 * 2**20  # enough for stable counts of the frequent tokens, ~20 s to tokenize
_SUFFIXES = (".py", ".md", ".rst", ".txt")
_FORMAT = 1


def corpus_files(max_bytes: int = CORPUS_BYTES) -> list[Path]:
    """Local text files in a fixed order: round-robin over installed packages, capped."""
    by_package: dict[str, list[Path]] = defaultdict(list)
    for entry in sorted({p for p in sys.path if p}):
        root = Path(entry)
        if not root.is_dir() or "site-packages" not in root.parts:
            continue
        for meta in sorted(root.glob("*.dist-info/METADATA")):
            by_package[meta.parent.name.split("-")[0].lower()].append(meta)
        for folder in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
            files = sorted(f for f in folder.rglob("*") if f.suffix in _SUFFIXES)
            by_package[folder.name.lower()] += [f for f in files if "test" not in f.name]
    queues = [by_package[name] for name in sorted(by_package)]
    chosen: list[Path] = []
    total, depth = 0, 0
    while total < max_bytes and any(depth < len(q) for q in queues):
        for queue in queues:
            if depth < len(queue) and total < max_bytes:
                size = queue[depth].stat().st_size
                if 0 < size < 2**20:  # skip empty and generated giants
                    chosen.append(queue[depth])
                    total += size
        depth += 1
    return chosen


def count_tokens(tokenizer: Any, files: list[Path], vocab_size: int) -> torch.Tensor:
    """Occurrences of every token id in `files` (texts encoded without special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if ids:
                counts.add_(torch.bincount(torch.tensor(ids), minlength=vocab_size)[:vocab_size])
        batch.clear()

    for path in files:
        try:
            batch.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if len(batch) >= 64:
            flush()
    flush()
    return counts


def token_counts(tokenizer: Any, vocab_size: int, max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """The cached counts for this tokenizer (computed on first use)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    key = hashlib.sha256(f"{_FORMAT}:{max_bytes}:{vocab_size}:{vocab}".encode()).hexdigest()[:16]
    path = cache_root() / "token-frequencies" / f"{key}.pt"
    if path.is_file():
        return torch.load(path)
    counts = count_tokens(tokenizer, corpus_files(max_bytes), vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(counts, partial)
    partial.replace(path)  # atomic: a concurrent reader sees all of it or nothing
    return counts


def frequent_tokens(
    tokenizer: Any, vocab_size: int, k: int, always: tuple[int, ...] = ()
) -> torch.Tensor:
    """The `k` most frequent token ids (ties: smaller id first), plus `always` (stop tokens,
    special tokens), sorted."""
    if k < 1:
        raise ValueError(f"head_tokens={k}: allowed: >= 1 (0 keeps the full head)")
    counts = token_counts(tokenizer, vocab_size)
    order = torch.argsort(-counts, stable=True)[: min(k, vocab_size)].tolist()
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size]
    keep = set(order) | {t for t in always if 0 <= t < vocab_size} | set(special)
    return torch.tensor(sorted(keep), dtype=torch.long)


def coverage(counts: torch.Tensor, keep: torch.Tensor) -> float:
    """Share of the corpus's token occurrences that `keep` covers."""
    total = int(counts.sum())
    return float(counts[keep].sum()) / total if total else 0.0
