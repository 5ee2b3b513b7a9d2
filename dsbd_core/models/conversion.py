"""The conversion cache: build a model directory once under `cache_root()`, atomically.

Converting a GGUF file de-quantises every tensor and takes ~20 s, so it is done once into a
float32 safetensors directory; `cached_conversion` writes every cache entry to a temporary name
and renames it into place, so a crash or a concurrent run never leaves a half-written entry
behind.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsbd_core.models.presets import cache_root


def converted_gguf(path: Path) -> Path:
    """Cache directory for a GGUF file (`gguf_entry`), converted there once."""
    return cached_conversion(gguf_entry(path), lambda out: convert_gguf(path, out))


def gguf_entry(path: Path) -> str:
    """The cache entry's name of a GGUF file: its name and what it holds (`content_digest`),
    not where it lies: the `smollm2` preset is its embedded file's entry, loading that file by
    its path finds it, and so does the same file installed anywhere else (a new virtual
    environment, a fresh clone's): a conversion costs ~25 s of one core and writes ~0.5 GB."""
    return f"gguf-{path.stem}-{content_digest(path)}"


def content_digest(path: Path) -> str:
    """The first 12 hex digits of the sha256 of what `path` holds: a cache key that follows a
    file's content, not its place. Hashing reads the file (~0.08 s for SmolLM2's 98 MB on the
    AMD EPYC), so it is done once per process for a file left as it was (same size and mtime):
    a process that loads the embedded pair resolves SmolLM2's file for the target and again for
    the distilled draft's base."""
    stat = path.stat()
    return _sha256(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """`content_digest` of `path` as it was at `size` and `mtime_ns` (the cache's key)."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()[:12]


def cached_conversion(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_root()/name`, built by `build(tmp_dir)` then renamed into place if missing."""
    final = cache_root() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # a concurrent run that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise `gguf` into a float32 transformers directory `out` (weights and tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are de-quantised float32 by now; without this save_pretrained refuses them.
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]  # PreTrainedModel's untyped attribute
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
