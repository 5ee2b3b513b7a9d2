"""Crash-safe writes for the teacher cache and the training run.

Every cache file and checkpoint is written to a temporary name and renamed into place, so a
file is either absent or complete: an interrupted build continues with the first missing shard
and an interrupted run resumes from its last whole checkpoint. The learning-curve log is
append-only JSONL, so earlier records survive whatever happens to a later one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary sibling and a rename (never a partial file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def atomic_save(obj: Any, path: Path) -> None:
    """`torch.save` to `path` via a temporary sibling and a rename (never a partial file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    tmp.replace(path)


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON record as a line of `path` (the run's learning-curve log)."""
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
