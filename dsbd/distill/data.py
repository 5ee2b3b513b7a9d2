"""The teacher cache as training data: sequences with their cached target rows, in batches.

The epoch's order is a pure function of (seed, epoch), so a checkpoint need not store it and a
resumed run visits the same batches as one never interrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


class TeacherData:
    """The cached shards, as sequences with their cached target rows."""

    def __init__(self, cache_dir: Path, shard_names: Sequence[str] | None = None) -> None:
        if shard_names is None:
            shard_names = find_shards(cache_dir)
        if not shard_names:
            raise ValueError(f"{cache_dir}: no cached shards; build the teacher cache first")
        self.shard_names = list(shard_names)
        self.shards = [torch.load(cache_dir / f"{n}.pt", weights_only=True) for n in shard_names]
        self.index: list[tuple[int, int, int]] = []  # (shard, sequence, first row)
        for s, shard in enumerate(self.shards):
            row = 0
            for q in range(len(shard["starts"])):
                self.index.append((s, q, row))
                length = int(shard["offsets"][q + 1] - shard["offsets"][q])
                row += length - int(shard["starts"][q])
        self.positions = sum(int(sh["topk_ids"].shape[0]) for sh in self.shards)

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, i: int):
        """Sequence `i`: its ids, first scored position, and cached top-k ids / logp / rest."""
        s, q, row = self.index[i]
        shard = self.shards[s]
        ids = shard["tokens"][shard["offsets"][q] : shard["offsets"][q + 1]].long()
        start = int(shard["starts"][q])
        rows = slice(row, row + len(ids) - start)
        return ids, start, shard["topk_ids"][rows], shard["topk_logp"][rows], shard["rest"][rows]

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's sequence order: a pure function of (seed, epoch)."""
        generator = torch.Generator().manual_seed(seed * 7919 + epoch)
        return torch.randperm(len(self), generator=generator)

    def batch(self, indices: Sequence[int], pad_id: int):
        """Right-padded ids, attention mask, (row, col) of each scored position, its targets."""
        items = [self.sequence(i) for i in indices]
        width = max(len(ids) for ids, *_ in items)
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        rows, cols = [], []
        for b, (seq, start, *_) in enumerate(items):
            ids[b, : len(seq)] = seq
            mask[b, : len(seq)] = 1
            # The prediction of token j is read at position j - 1.
            cols.append(torch.arange(start - 1, len(seq) - 1))
            rows.append(torch.full((len(seq) - start,), b))
        topk_ids = torch.cat([it[2] for it in items]).long()
        topk_logp = torch.cat([it[3] for it in items]).float()
        rest = torch.cat([it[4] for it in items]).float()
        return ids, mask, torch.cat(rows), torch.cat(cols), topk_ids, topk_logp, rest


def find_shards(cache_dir: Path) -> list[str]:
    """The shards in `cache_dir` now, in `TeacherData`'s order (a growing cache adds some)."""
    return sorted(p.stem for p in cache_dir.glob("*.pt"))
