"""The ε over-acceptance rule, Decoding-OPT and Decoding-UNO, in closed form (THEORY.md §5.4, §9.3).

Why: this is the product's lossy speed knob (`SamplingConfig.epsilon`). A draft token d is
accepted with probability `min(1, (target(d) + ε) / draft(d))`; on rejection the next token is
drawn from the ordinary residual `norm((target - draft)_+)` (Decoding-OPT, which Theorem 4 shows
is an optimal resampling law for this b) rather than from the target itself (Decoding-UNO, the
natural but dominated choice). Closed forms, single position:

* rejection `R(ε) = Σ_x (draft(x) - target(x) - ε)_+`;
* least bias `Loss*(ε) = Σ_x min(ε, (draft(x) - target(x))_+) = TV - R(ε)` — on the Pareto
  front; NOT bounded by ε in general (up to ε · #{x : draft > target}, and at most TV);
* OPT law `min(draft, target + ε) + R(ε) · residual`, whose TV to the target is `Loss*(ε)`;
* UNO law `min(draft, target + ε) + R(ε) · target`, TV ≥ `Loss*(ε)`.

`eps` may be a scalar or an array broadcasting against the vocabulary axis: the product applies
ε only inside the support of the (filtered) target, i.e. `eps · [target > 0]`, and every formula
here holds token by token for such a vector.

For a DSBD layer (several candidates, residual chain, single selection) the module also gives
the layer law and the [derived] bias bound of THEORY.md §9.3 item 6, `Σ_m (Π_{j<m} R_j) β_m`, with
`β_m = Σ_x min(ε, (draft - c_m)_+)` the stage's decision bias; the engine reports the realised
sum of `β` over the stages it executed (`DecodeStats.epsilon_bias_bound`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from dsbd.theory.chains import MarkovChain
from dsbd.theory.distributions import residual, tv

Resample = Literal["opt", "uno"]


def overaccept_acceptance(
    target: np.ndarray, draft: np.ndarray, eps: float | np.ndarray
) -> np.ndarray:
    """`b(x) = min(1, (target(x) + ε) / draft(x))`; 1 where draft(x) = 0 (never proposed)."""
    target, draft = np.asarray(target, np.float64), np.asarray(draft, np.float64)
    safe = np.where(draft > 0, draft, 1.0)
    return np.where(draft > 0, np.minimum(1.0, (target + eps) / safe), 1.0)


def overaccept_rejection(
    target: np.ndarray, draft: np.ndarray, eps: float | np.ndarray
) -> np.ndarray:
    """`R(ε) = Σ_x (draft(x) - target(x) - ε)_+` (probability the draft is refused)."""
    return np.maximum(np.asarray(draft) - np.asarray(target) - eps, 0.0).sum(-1)


def overaccept_bias(target: np.ndarray, draft: np.ndarray, eps: float | np.ndarray) -> np.ndarray:
    """`Loss*(ε) = Σ_x min(ε, (draft(x) - target(x))_+)`: least TV bias of one step (= OPT's)."""
    gap = np.maximum(np.asarray(draft) - np.asarray(target), 0.0)
    return np.minimum(eps, gap).sum(-1)


def resample_law(target: np.ndarray, draft: np.ndarray, mode: Resample) -> np.ndarray:
    """Law drawn after a rejection: the SD residual (`"opt"`) or the target (`"uno"`)."""
    if mode == "opt":
        return residual(target, draft)[0]
    if mode == "uno":
        return np.asarray(target, np.float64)
    raise ValueError(f"mode={mode!r}: allowed 'opt' or 'uno'")


def overaccept_step_law(
    target: np.ndarray, draft: np.ndarray, eps: float | np.ndarray, mode: Resample = "opt"
) -> np.ndarray:
    """Output law of one ε step: `min(draft, target + ε) + R(ε) · resample`."""
    accepted = np.minimum(np.asarray(draft, np.float64), np.asarray(target) + eps)
    rejection = 1.0 - accepted.sum(-1)
    return accepted + rejection[..., None] * resample_law(target, draft, mode)


def overaccept_layer(
    target: np.ndarray, draft: np.ndarray, drafts: int, eps: float | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One DSBD layer with single selection (K = 1) under the ε rule, `drafts` i.i.d. drafts.

    Stage m compares against the exact chain state `c_m` (c_1 = target, c_{m+1} = ordinary
    residual), accepts x with mass `min(draft, c_m + ε)`, and the last fallback is `c_{M+1}`.
    Returns `(law [..., V], rejection = Π_m R_m, bias_bound = Σ_m (Π_{j<m} R_j) β_m)`. The
    bound dominates `TV(law, target)` (stage-wise coupling with the exact chain).
    """
    chain = np.asarray(target, np.float64)
    draft = np.asarray(draft, np.float64)
    reach = np.ones(chain.shape[:-1])
    law = np.zeros_like(chain)
    bound = np.zeros(chain.shape[:-1])
    for _ in range(drafts):
        accepted = np.minimum(draft, chain + eps)
        law = law + reach[..., None] * accepted
        bound = bound + reach * overaccept_bias(chain, draft, eps)
        reach = reach * (1.0 - accepted.sum(-1))
        chain = residual(chain, draft)[0]
    return law + reach[..., None] * chain, reach, bound


def overaccept_chain(
    chain: MarkovChain,
    eps: float,
    mode: Resample = "opt",
    prefix: Literal["target", "own"] = "target",
) -> dict[str, float]:
    """Expected rejections and summed per-step bias of the ε rule along a Markov chain.

    prefix="target": prefixes averaged under the target's law, the measure of Theorems 1-5, so
    the per-position identity `R + Loss* = TV` adds up and OPT lies exactly on the chain-level
    front `Σ_n E_target TV_n` (UNO above it). prefix="own": prefixes follow the ε decoder's own
    law — what a run actually sees; then `bias` (= Σ_n E[TV(step law, target_n)]) is the
    hybrid-argument upper bound on the TV between the decoder's sequence law and the target's.
    Returns {"rejections", "bias", "front"} with front = Σ_n E TV_n under the same prefix law.
    """
    mu = chain.initial.copy()
    totals = {"rejections": 0.0, "bias": 0.0, "front": 0.0}
    for n in range(chain.horizon):
        draft, target = chain.draft[n], chain.target[n]
        law = overaccept_step_law(target, draft, eps, mode)
        totals["rejections"] += float(mu @ overaccept_rejection(target, draft, eps))
        totals["bias"] += float(mu @ tv(law, target))
        totals["front"] += float(mu @ tv(target, draft))
        mu = mu @ (target if prefix == "target" else law)
    return totals
