"""Single-position primitives of speculative decoding theory (THEORY.md §1, §2, §4.3).

Why a separate module: every theorem in this package (SD, batch SD, the Pareto front, the
ε rule) is built from the same three operations on one pair of next-token distributions —
total variation, the residual `norm((target - draft)_+)` and the residual chain of recursive
rejection. Keeping them here, tested once, means the sequence-level formulas and the product's
verifier share one definition.

Naming: the paper calls the draft `p` and the target `q`; here arguments are always
`target` and `draft`. Every function works on numpy arrays whose LAST axis is the vocabulary
and broadcasts over leading axes (so a whole transition matrix `[S, S]` is one call).
"""

from __future__ import annotations

import numpy as np


def tv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Total variation `½ Σ_x |a(x) - b(x)|` over the last axis."""
    return 0.5 * np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).sum(-1)


def residual(target: np.ndarray, draft: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(norm((target - draft)_+), mass)`: the law drawn after a rejection, and its mass.

    The mass `Σ_x (target - draft)_+` equals `TV(target, draft)` when both are distributions
    (a sub-stochastic `target`, e.g. a later residual, is allowed). Where the mass is zero the
    residual is undefined and is never sampled (a rejection there has probability 0); we return
    `target` itself so callers never see NaN (THEORY.md §7 edge cases).
    """
    target = np.asarray(target, dtype=np.float64)
    rest = np.maximum(target - np.asarray(draft, dtype=np.float64), 0.0)
    mass = rest.sum(-1)
    safe = np.where(mass > 0, mass, 1.0)[..., None]
    return np.where(mass[..., None] > 0, rest / safe, target), mass


def residual_chain(
    target: np.ndarray, draft: np.ndarray, drafts: int
) -> tuple[np.ndarray, np.ndarray]:
    """Recursive rejection with `drafts` i.i.d. candidates (THEORY.md §4.2).

    `c_1 = target`, `c_{m+1} = norm((c_m - draft)_+)`, `r_m = Σ_x (c_m - draft)_+` = the
    probability that candidate m is rejected given that candidates 1..m-1 were.
    Returns `(r [..., drafts], c_{drafts+1} [..., V])` — the layer-failure probability of
    DSBD/batch SD is `r.prod(-1)` and the fallback law is `c_{drafts+1}`.
    """
    chain = np.asarray(target, dtype=np.float64)
    rejections = []
    for _ in range(drafts):
        chain, mass = residual(chain, draft)
        rejections.append(mass)
    shape = chain.shape[:-1] + (0,)
    r = np.stack(rejections, axis=-1) if rejections else np.zeros(shape)
    return r, chain


def sd_step_law(target: np.ndarray, draft: np.ndarray) -> np.ndarray:
    """Output law of one SD step, analytically: `min(draft, target) + TV · residual`.

    Equals `target` exactly (Theorem 1 (2)); tests use it as the single-step exactness check.
    """
    rest, mass = residual(target, draft)
    return np.minimum(draft, target) + mass[..., None] * rest


def batch_root_law(target: np.ndarray, draft: np.ndarray, drafts: int) -> np.ndarray:
    """Output law of the root of a batch-SD round (Algorithm 4, step 3), analytically:
    `Σ_m (Π_{j<m} r_j) · min(draft, c_m) + (Π_j r_j) · c_{M+1}`. Equals `target` (Theorem 3)."""
    chain = np.asarray(target, dtype=np.float64)
    reach = np.ones(chain.shape[:-1])
    out = np.zeros_like(chain)
    for _ in range(drafts):
        out = out + reach[..., None] * np.minimum(draft, chain)
        chain, mass = residual(chain, draft)
        reach = reach * mass
    return out + reach[..., None] * chain


def batch_improvement(target: np.ndarray, draft: np.ndarray, drafts: int) -> np.ndarray:
    """`BI_M = TV - Π_{m≤M} r_m`: root rejection saved by M drafts vs one (THEORY.md §4.3)."""
    r, _ = residual_chain(target, draft, drafts)
    return tv(target, draft) - r.prod(-1)


def bernoulli_batch_improvement(draft_p: float, target_p: float, drafts: int) -> float:
    """Closed form of `BI_M` for draft Ber(u), target Ber(v), u ≥ v: `(u - v)(1 - u^{M-1})`."""
    u, v = draft_p, target_p
    if u < v:
        raise ValueError(f"the closed form needs draft_p >= target_p, got {u} < {v}")
    return (u - v) * (1.0 - u ** (drafts - 1))


def uniform_batch_improvement(ratio: float, drafts: int) -> float:
    """Closed form of `BI_M` for draft Unif(V), target Unif(V'), r = V/V' ≥ 1:
    `(1 - 1/r) - (1 - 1/r)^M`."""
    tv_value = 1.0 - 1.0 / ratio
    return tv_value - tv_value**drafts
