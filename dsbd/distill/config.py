"""The settings of a distillation run: the draft's architecture (`DraftSpec`), the optimisation
(`TrainConfig`) and which of them a resumed run may change. Torch-free: `dsbd --help` reads
the defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DraftSpec:
    """The draft's architecture: `cut` or `small` (`dsbd.distill.draft` says what each is)."""

    arch: str = "cut"  # "cut" | "small"
    layers: int = 4
    hidden: int = 256  # small only
    intermediate: int | None = None  # small only; default ~2.7 x hidden

    def __post_init__(self) -> None:
        if self.arch not in ("cut", "small"):
            raise ValueError(f"arch={self.arch!r}: allowed 'cut' or 'small'")
        if self.layers < 1:
            raise ValueError(f"layers={self.layers}: must be >= 1")


@dataclass
class TrainConfig:
    """Optimisation settings. `steps` fixes the learning-rate schedule (warm-up, cosine)."""

    steps: int = 4000
    batch_size: int = 16  # sequences per step
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tv_weight: float = 0.0  # loss = KL(p||q) + tv_weight * TV(p, q) (top-k estimate)
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 25
    log_every: int = 5
    # Re-scan the cache for new shards at every epoch boundary (train while the cache grows).
    grow_data: bool = False

    def lr_at(self, step: int) -> float:
        """Linear warm-up over `warmup` steps, then cosine decay to `min_lr_ratio * lr`."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (
            self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        )


# Settings that may change between a run and its resumption: the first three do not alter the
# weights; a new `steps` re-plans the learning-rate schedule from the current step on (extend a
# run, or end it sooner with an annealed draft) and a new `tv_weight` changes the objective from
# the current step on. Resuming with the same settings is bit-exact.
RESUMABLE_CHANGES = ("eval_every", "checkpoint_every", "log_every", "steps", "tv_weight")
