"""Phase 1, the teacher cache (`build_cache`): the target's distributions, computed once.

The target's next-token distributions are stored as top-k log-probabilities plus the remaining
mass, so training epochs never pay the target's forward pass again. Training text is (a)
continuations the target samples from training prompts (`dsbd.prompts`: the text a
decoder meets), and (b) chunks of local text (`text`), teacher forced. The cache is a directory
of shards (`sample-00000.pt`, `text-00000.pt`, ...) written atomically one by one; an
interrupted build continues with the first missing shard, and asking for more samples later
only adds shards. `heldout.json` keeps the held-out evaluation sequences (target samples on
`prompts.EVAL_PROMPTS`, the same ones `dsbd eval-acceptance` scores).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dsbd.acceptance import (
    ScoredSequence,
    encode_prompt_for,
    model_device,
    sample_prompt_continuations,
)
from dsbd.acceptance import sample_continuations as _sample
from dsbd.distill.files import atomic_save, atomic_write_text
from dsbd.distill.identity import CacheConfig, CachePlan, cache_differences, cache_meta
from dsbd.distill.text import text_chunks
from dsbd.prompts import EVAL_PROMPTS, Prompt, training_prompts


def build_cache(
    target,
    cache_dir: Path,
    config: CacheConfig,
    plan: CachePlan,
    *,
    prompts: Sequence[Prompt] | None = None,
    text_sources: Sequence[Path] | None = None,
    heldout_prompts: Sequence[Prompt] = EVAL_PROMPTS,
    progress: Callable[[str], None] = print,
) -> None:
    """Create or extend the teacher cache in `cache_dir` for `target` (a `LoadedModel`).

    `prompts` defaults to `prompts.training_prompts(seed)`; `text_sources` to the sources and
    READMEs of a few installed packages. Both are frozen into the cache when it is created
    (`prompts.jsonl`, `text.json`), so extending it later samples the same distribution.
    """
    from dsbd_core.models import stop_token_ids

    cache_dir.mkdir(parents=True, exist_ok=True)
    _check_or_write_meta(cache_dir, cache_meta(target, config))

    prompts_path = cache_dir / "prompts.jsonl"
    if not prompts_path.exists():
        chosen = list(prompts) if prompts is not None else training_prompts(config.seed)
        atomic_write_text(prompts_path, "\n".join(p.to_json() for p in chosen) + "\n")
    from dsbd.prompts import load_prompts

    train_prompts = load_prompts(prompts_path)
    stops = stop_token_ids(target)
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else stops[0] if stops else 0

    heldout_path = cache_dir / "heldout.json"
    if not heldout_path.exists():
        progress(f"held-out set: sampling {len(heldout_prompts)} target continuations")
        sequences = sample_prompt_continuations(
            target, heldout_prompts, config.heldout_tokens, config.temperature, config.seed
        )
        atomic_write_text(heldout_path, json.dumps([_sequence_json(s) for s in sequences]))

    shards = _shard_names(plan, config)
    chunks: list[list[int]] | None = None
    for index, name in enumerate(shards):
        path = cache_dir / f"{name}.pt"
        if path.exists():
            continue
        start = time.perf_counter()
        kind, digits = name.split("-")
        number = int(digits)
        if kind == "sample":
            shard = _sample_shard(target, train_prompts, number, config, stops, pad)
        else:
            if chunks is None:
                chunks = text_chunks(target, cache_dir, config, plan, text_sources)
            shard = _text_shard(target, chunks, number, config)
        atomic_save(shard, path)
        rows = shard["topk_ids"].shape[0]
        progress(
            f"shard {index + 1}/{len(shards)} {name}: {rows} positions in "
            f"{time.perf_counter() - start:.0f} s"
        )


def _check_or_write_meta(cache_dir: Path, meta: dict) -> None:
    """Record `meta` in a new cache; refuse an existing cache whose `meta.json` differs."""
    meta_path = cache_dir / "meta.json"
    if meta_path.exists():
        differences = cache_differences(json.loads(meta_path.read_text()), meta)
        if differences:
            raise ValueError(
                f"{cache_dir} holds a teacher cache built with other settings ("
                + "; ".join(differences)
                + "); use another --work-dir, or the same target and settings"
            )
    else:
        atomic_write_text(meta_path, json.dumps(meta, indent=2))


def load_heldout(cache_dir: Path) -> list[ScoredSequence]:
    """The cache's held-out evaluation sequences (`heldout.json`)."""
    return [
        ScoredSequence(tuple(s["token_ids"]), s["start"], s["kind"])
        for s in json.loads((cache_dir / "heldout.json").read_text())
    ]


def _sequence_json(sequence: ScoredSequence) -> dict:
    return {"token_ids": list(sequence.token_ids), "start": sequence.start, "kind": sequence.kind}


def _shard_names(plan: CachePlan, config: CacheConfig) -> list[str]:
    """Shard build order: sample and text shards interleaved in proportion."""
    n_sample = math.ceil(plan.samples / config.shard_size)
    n_text = math.ceil(plan.text_chunks / config.shard_size)
    order = [(i / max(n_sample, 1), f"sample-{i:05d}") for i in range(n_sample)]
    order += [((i + 0.5) / max(n_text, 1), f"text-{i:05d}") for i in range(n_text)]
    return [name for _, name in sorted(order)]


def _topk_rows(logits: torch.Tensor, top_k: int, temperature: float) -> dict[str, torch.Tensor]:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    rest = (1.0 - values.double().exp().sum(-1)).clamp(min=0.0).float()
    # Stored on the CPU whatever the target's device (no-op moves there).
    return {"topk_ids": ids.int().cpu(), "topk_logp": values.half().cpu(), "rest": rest.cpu()}


def _pack(
    sequences: list[tuple[list[int], int]], rows: list[dict[str, torch.Tensor]], kinds: list[str]
):
    lengths = torch.tensor([len(ids) for ids, _ in sequences], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return {
        "tokens": torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.int32),
        "offsets": offsets,
        "starts": torch.tensor([start for _, start in sequences], dtype=torch.int32),
        "kinds": kinds,
        **{key: torch.cat([r[key] for r in rows]) for key in ("topk_ids", "topk_logp", "rest")},
    }


def _sample_shard(target, prompts: list[Prompt], number: int, config: CacheConfig, stops, pad):
    size = config.shard_size
    chosen = [prompts[(number * size + i) % len(prompts)] for i in range(size)]
    ids = [encode_prompt_for(target, p) for p in chosen]
    # Batch prompts of similar length together (less padding); the order is deterministic.
    order = sorted(range(size), key=lambda i: (len(ids[i]), i))
    sequences, logits = _sample(
        target.model,
        [ids[i] for i in order],
        new_tokens=config.new_tokens,
        temperature=config.temperature,
        seed=config.seed * 1_000_003 + number,
        stop_ids=stops,
        pad_id=pad,
        batch_size=config.batch_size,
        kinds=[chosen[i].kind for i in order],
        return_logits=True,
    )
    rows = [_topk_rows(lg, config.top_k, config.temperature) for lg in logits]
    return _pack(
        [(list(s.token_ids), s.start) for s in sequences], rows, [s.kind for s in sequences]
    )


@torch.inference_mode()
def _text_shard(target, chunks: list[list[int]], number: int, config: CacheConfig):
    size = config.shard_size
    chosen = chunks[number * size : (number + 1) * size]
    if not chosen:
        raise ValueError(f"text shard {number}: not enough local text chunks")
    sequences, rows = [], []
    for start in range(0, len(chosen), config.batch_size):
        batch = torch.tensor(chosen[start : start + config.batch_size])
        logits = target.model(batch.to(model_device(target.model))).logits[:, :-1]
        for row in range(batch.shape[0]):
            sequences.append((batch[row].tolist(), 1))
            rows.append(_topk_rows(logits[row], config.top_k, config.temperature))
    return _pack(sequences, rows, ["text"] * len(sequences))
