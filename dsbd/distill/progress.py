"""Progress reporting of `train`: a tqdm bar with the smoothed loss and held-out acceptance.

Reporting only: nothing here touches the weights, the RNG or the checkpoint.
"""

from __future__ import annotations


class TrainingBar:
    """The step bar: steps done of `total`, the loss (exponentially smoothed over ~20 steps)
    and the last held-out acceptance."""

    def __init__(self, total: int, initial: int, enabled: bool, last_acceptance: float) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total,
            initial=initial,
            disable=not enabled,
            dynamic_ncols=True,
            desc="distill",
            unit="step",
        )
        self._smooth: float | None = None
        self.last_acceptance = last_acceptance

    def step(self, loss: float, acceptance: float | None = None) -> None:
        """Count one step with its `loss` and, when it was evaluated, its held-out acceptance."""
        self._smooth = loss if self._smooth is None else 0.95 * self._smooth + 0.05 * loss
        if acceptance is not None:
            self.last_acceptance = acceptance
        self._bar.set_postfix(
            loss=f"{self._smooth:.3f}", acc=f"{self.last_acceptance:.3f}", refresh=False
        )
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
