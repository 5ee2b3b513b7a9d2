"""Local text for the teacher cache: chunks of installed packages' sources and READMEs.

Teacher forced, these add text the target did not write itself (code, documentation) to the
sampled continuations, with no download. The chunks are chosen once and frozen in `text.json`,
so extending the cache later scores the same distribution.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from dsbd.distill.files import atomic_write_text
from dsbd.distill.identity import CacheConfig, CachePlan


def default_text_sources(packages: Sequence[str] = ("numpy", "pydantic", "pip", "transformers")):
    """Local text: package READMEs (dist-info METADATA, *.md / *.rst) and Python sources."""
    import sys

    sources: list[Path] = []
    for entry in sys.path:
        root = Path(entry)
        if not root.is_dir():
            continue
        sources += sorted(root.glob("*.dist-info/METADATA"))
        for package in packages:
            folder = root / package
            if (folder / "__init__.py").is_file():
                sources += sorted(folder.rglob("*.md")) + sorted(folder.rglob("*.rst"))
                sources += sorted(folder.rglob("*.py"))
    return sources


def text_chunks(target, cache_dir: Path, config: CacheConfig, plan: CachePlan, sources):
    """`plan.text_chunks` token chunks of local text, chosen once and frozen in `text.json`."""
    path = cache_dir / "text.json"
    if path.exists():
        chunks = json.loads(path.read_text())
        if len(chunks) >= plan.text_chunks:
            return chunks
    files = list(sources) if sources is not None else default_text_sources()
    rng = random.Random(config.seed)
    rng.shuffle(files)
    chunks = []
    for file in files:
        if len(chunks) >= max(plan.text_chunks, 1):
            break
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = target.tokenizer.encode(text, add_special_tokens=False)
        # At most two chunks per file, from random places: many files, little repetition.
        spans = list(range(0, len(ids) - config.text_len + 1, config.text_len))
        for begin in rng.sample(spans, min(2, len(spans))):
            chunks.append(ids[begin : begin + config.text_len])
    atomic_write_text(path, json.dumps(chunks))
    return chunks
