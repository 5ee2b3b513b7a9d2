"""Held-out acceptance of the draft during training: the figure the learning curve tracks.

The held-out sequences are the cache's (`heldout.json`: target samples on the prompts that
`dsbd eval-acceptance` scores), so the curve and `dsbd eval-acceptance` measure the same thing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsbd.acceptance import measure_acceptance, next_token_probs
from dsbd.distill.cache import load_heldout


class HeldoutEvaluator:
    """Scores a draft against the target on the cache's held-out sequences (none when the cache
    has no `heldout.json`). The target's distributions on them are computed once, at the first
    evaluation, and reused (the target does not change during training)."""

    def __init__(self, target_model, cache_dir: Path, temperature: float) -> None:
        self.target_model = target_model
        self.temperature = temperature
        self.sequences = load_heldout(cache_dir) if (cache_dir / "heldout.json").exists() else []
        self._target_probs: list[torch.Tensor] = []  # computed at the first evaluation

    def __bool__(self) -> bool:
        """Whether there is anything to evaluate on."""
        return bool(self.sequences)

    def __call__(self, draft) -> dict:
        """The acceptance report (`AcceptanceReport.as_dict`) of `draft`, left in train mode."""
        if not self._target_probs:
            self._target_probs.extend(
                next_token_probs(self.target_model, s, self.temperature).half()
                for s in self.sequences
            )
        draft.eval()
        report = measure_acceptance(
            self.target_model,
            draft,
            self.sequences,
            temperature=self.temperature,
            target_probs=self._target_probs,
        )
        draft.train()
        return report.as_dict()
