"""What a teacher cache was built with and for: its settings and its target's identity.

`meta.json` records every setting that changes the cached rows (`CacheConfig`) and the
target's identity (`target_identity`), so a cache is never extended or trained on under other
settings or for another target (`cache_differences` says what differs).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# 2: `config` includes the sampling batch size and `target_identity` is recorded (format 1
# caches record neither, so they cannot be checked against the target and are refused).
CACHE_FORMAT = 2


@dataclass
class CacheConfig:
    """What goes into a teacher cache. Fixed when the cache is created (see `meta.json`)."""

    top_k: int = 64
    new_tokens: int = 80  # sampled continuation length (training)
    heldout_tokens: int = 64  # held-out continuation length (= eval-acceptance's default)
    temperature: float = 1.0
    shard_size: int = 64  # sequences per shard
    batch_size: int = 16  # sampling batch (`dsbd distill --sample-batch`)
    text_len: int = 128  # tokens per local-text chunk
    seed: int = 0

    def fingerprint(self) -> dict:
        """Every field, the sampling batch size included: one generator feeds the batches in
        turn, one draw per row and step, so another batch size samples other tokens (and so
        caches other sequences), not just other round-off."""
        return asdict(self)


@dataclass
class CachePlan:
    """How much to cache: sampled sequences and local-text chunks (growable later)."""

    samples: int = 2048
    text_chunks: int = 256


def cache_meta(target, config: CacheConfig) -> dict:
    """`meta.json` of a cache for `target` (a `LoadedModel`): what must match to reuse it."""
    return {"format": CACHE_FORMAT, **identity_fields(target), "config": config.fingerprint()}


# Config entries that say where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "use_cache", "dtype", "torch_dtype")
_SAMPLED_PER_TENSOR = 4096


def target_identity(model: PreTrainedModel) -> dict[str, str]:
    """What identifies a target for its teacher cache, whatever it was loaded from.

    The vocabulary size alone does not: a fine-tune, another size of the same family or a
    re-quantisation shares it while giving other distributions. `config` hashes the model's
    config (minus load-time entries); `weights` hashes every parameter's name, shape and an
    evenly strided sample of ~4k of its values, which any real change of the weights (training,
    merging, another quantisation) alters, at a cost of milliseconds instead of hashing
    gigabytes. Both are computed on the CPU, so they do not depend on the device.
    """
    config = {
        key: value
        for key, value in model.config.to_dict().items()
        if not key.startswith("_") and key not in _VOLATILE_CONFIG_KEYS
    }
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    weights = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLED_PER_TENSOR)].float().cpu().contiguous()
        weights.update(f"{name}:{tuple(param.shape)}:".encode())
        weights.update(sample.numpy().tobytes())
    return {"config": config_hash.hexdigest(), "weights": weights.hexdigest()}


def default_work_dir(target) -> Path:
    """`~/.cache/dsbd/distill/<target name>-<identity>`: readable, and keyed by the target's
    identity so two targets with the same base name (`a/model`, `b/model`) never share a cache,
    while the same target loaded from another path finds its cache again."""
    base = Path(target.name).name or "target"
    identity = target_identity(target.model)
    key = hashlib.sha256(f"{identity['config']}{identity['weights']}".encode()).hexdigest()
    return Path.home() / ".cache" / "dsbd" / "distill" / f"{base}-{key[:12]}"


def cache_differences(existing: dict, meta: dict) -> list[str]:
    """What differs between a cache's recorded `meta.json` and the one this run would write,
    each as `what: recorded -> now`; empty when the cache may be reused."""
    if existing.get("format") != meta["format"]:
        return [
            f"format: {existing.get('format')} -> {meta['format']} (a format-1 cache records "
            "neither the sampling batch size nor the target's identity)"
        ]
    differences = []
    recorded, current = existing.get("target_identity", {}), meta["target_identity"]
    for part in ("config", "weights"):
        if recorded.get(part) != current[part]:
            differences.append(
                f"target {part}: {str(recorded.get(part))[:12]}... (built for "
                f"{existing.get('target')!r}) -> {current[part][:12]}... ({meta['target']!r})"
            )
    if existing.get("vocab_size") != meta["vocab_size"]:
        differences.append(f"vocab_size: {existing.get('vocab_size')} -> {meta['vocab_size']}")
    old_config = existing.get("config", {})
    differences += [
        f"{key}: {old_config.get(key)} -> {value}"
        for key, value in meta["config"].items()
        if old_config.get(key) != value
    ]
    return differences


def identity_fields(target) -> dict:
    """The `meta.json` fields that identify `target` (see `cache_meta`)."""
    return {
        "target": target.name,
        "target_identity": target_identity(target.model),
        "vocab_size": target.vocab_size,
    }


def cache_meta_for_training(target, cache_dir: Path) -> dict:
    """The cache's `meta.json`, once checked to be for `target`; raises ValueError otherwise.

    The cut draft starts from this target and learns its cached distributions: both must be
    the cache's target (the format is checked first: a format-1 cache records no identity).
    """
    meta = json.loads((cache_dir / "meta.json").read_text())
    now = {**meta, **identity_fields(target), "format": CACHE_FORMAT}
    differences = cache_differences(meta, now)
    if differences:
        raise ValueError(
            f"{cache_dir}: the teacher cache does not fit this target ("
            + "; ".join(differences)
            + "); train with the target it was built for, or build a cache for this one "
            "(another --work-dir)"
        )
    return meta
