"""Theorems 4 and 5: the least bias for a given acceptance rule, and the rejection/bias front
(THEORY.md §5, single position, prefix suppressed).

Why: a verifier that accepts *more* than SD's `min(1, target/draft)` rejects less (faster) but
is biased. Theorem 4 gives the smallest bias any resampling law can achieve for a fixed
acceptance function `b`; Theorem 5 shows `P(reject) + least bias = TV(draft, target)` for every
over-accepting `b` — a straight front from SD (bias 0, rejections TV) to "accept everything"
(rejections 0, bias TV). Nothing can do better, so a lossy knob should be judged by its distance
to this line; the ε rule with the ordinary residual (Decoding-OPT) lies on it.

`accept` is b(x) ∈ [0, 1] per token (last axis), broadcasting like the other primitives.
"""

from __future__ import annotations

import numpy as np

from dsbd.theory.distributions import tv


def rejection_probability(draft: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """`R = Σ_x (1 - b(x)) draft(x)`: probability that the drafted token is refused."""
    return ((1.0 - np.asarray(accept)) * np.asarray(draft)).sum(-1)


def least_bias(target: np.ndarray, draft: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """Theorem 4's value `Loss*_TV(b) = min over resampling laws of TV(output, target)`.

    In the [derived] form `Σ_x (b(x) draft(x) - target(x))_+`: the mass the acceptance step
    alone already over-delivers, which no resampling can take back. Equals the paper's
    `½ Σ|target - b·draft| - ½ R` when R > 0, and the right value TV when R = 0.
    """
    return np.maximum(np.asarray(accept) * np.asarray(draft) - np.asarray(target), 0.0).sum(-1)


def least_bias_paper_form(target: np.ndarray, draft: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """Theorem 4's value as printed: `½ Σ_x |target - b·draft| - ½ R` (needs R > 0)."""
    accepted_mass = np.asarray(accept) * np.asarray(draft)
    return 0.5 * np.abs(np.asarray(target) - accepted_mass).sum(-1) - 0.5 * rejection_probability(
        draft, accept
    )


def optimal_resample_bound(target: np.ndarray, draft: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """`A(x) = (target(x) - b(x) draft(x)) / R` (Theorem 4). The optimal resampling laws are
    exactly those with `P* = 0` where `A < 0` and `0 ≤ P* ≤ A` where `A ≥ 0`. Needs R > 0."""
    rest = np.asarray(target) - np.asarray(accept) * np.asarray(draft)
    return rest / rejection_probability(draft, accept)[..., None]


def output_law(
    target: np.ndarray, draft: np.ndarray, accept: np.ndarray, resample: np.ndarray
) -> np.ndarray:
    """Law of one position of the rejection template: `b·draft + R · resample`."""
    accepted_mass = np.asarray(accept) * np.asarray(draft)
    return accepted_mass + rejection_probability(draft, accept)[..., None] * np.asarray(resample)


def pareto_front(tv_value: float, points: int = 101) -> tuple[np.ndarray, np.ndarray]:
    """Theorem 5's front for a pair at distance `tv_value`: (rejection, least bias) along the
    segment from (TV, 0) to (0, TV). Every over-accepting rule lies on it when it resamples
    optimally; any other resampling lies above it."""
    rejection = np.linspace(tv_value, 0.0, points)
    return rejection, tv_value - rejection


def front_gap(
    target: np.ndarray, draft: np.ndarray, accept: np.ndarray, bias: np.ndarray
) -> np.ndarray:
    """Distance above the front: `R + bias - TV` (0 on the front, > 0 for suboptimal
    resampling; never < 0 for an over-accepting b by Theorem 5)."""
    return rejection_probability(draft, accept) + np.asarray(bias) - tv(target, draft)
