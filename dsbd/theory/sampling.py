"""Vectorised categorical draws for the Monte-Carlo samplers of this package.

Why: the samplers simulate many independent runs at once (one numpy row per run), so each
position costs a handful of array operations instead of a Python loop over runs.
"""

from __future__ import annotations

import numpy as np


def draw_rows(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of `probs` ([N, S], rows need not be normalised): index [N].

    Inverse CDF: index = #{i : cdf_i < u · total}. A zero-mass entry has cdf_i = cdf_{i-1},
    so it is never selected (up to the measure-zero event u · total == cdf_i).
    """
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[0]) * cdf[:, -1]
    index = (cdf < u[:, None]).sum(axis=-1)
    return np.minimum(index, probs.shape[-1] - 1)


def take(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """`rows[i, index[i]]` for every i."""
    return np.take_along_axis(rows, index[:, None], axis=-1)[:, 0]
