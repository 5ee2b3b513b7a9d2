"""Batch speculative decoding (Algorithm 4), Theorem 3 and Proposition 1 (THEORY.md §4).

Why: DSBD verifies several draft candidates per layer with the same recursive-residual rule as
Yin et al.'s batch SD does at the root of a round. Theorem 3 gives the expected rejections of
batch SD with M i.i.d. drafts, Proposition 1 its limit as M grows (rejections do not vanish:
after a root acceptance the round continues along a single branch with plain SD). These numbers
say how much extra draft width can buy at best, which is what a width controller trades off.

Semantics implemented (THEORY.md §4.1): a round starts at a *root* position, draws M i.i.d. draft
continuations, verifies their first tokens one after another against the residual chain
`c_1 = target, c_{m+1} = norm((c_m - draft)_+)`, falls back to `c_{M+1}` (a rejection) if all
fail, and otherwise continues along the accepted branch with plain SD until the first
rejection, which ends the round (the next position is a new root).
"""

from __future__ import annotations

import numpy as np

from dsbd.theory.chains import MarkovChain
from dsbd.theory.distributions import residual, residual_chain, tv
from dsbd.theory.sampling import draw_rows, take


def rejections_per_position_batch(chain: MarkovChain, drafts: int) -> np.ndarray:
    """`[T]` expected rejections per position of batch SD with `drafts` (= M) drafts.

    The reference recursion of THEORY.md §4.2 on the chain's last-state marginals: `mu` is the
    target law of the previous token; `F` the pseudo-measure "the previous token was emitted by
    a rejection", i.e. position n is the root of a round (position 1 always is). Position n
    rejects with probability `TV` if it is not a root and `Π_m r_m` if it is, hence
    `E[R_n] = mu·TV - F·(TV - Π r)`; then `F' = mu@H - F@(H - Π r · c_{M+1})` with
    `H = (target - draft)_+` (paper eq. (22)).
    """
    if drafts < 1:
        raise ValueError(f"drafts={drafts}: at least one draft is required")
    mu = chain.initial.copy()
    root = chain.initial.copy()
    out = np.empty(chain.horizon)
    for n in range(chain.horizon):
        draft, target = chain.draft[n], chain.target[n]
        tv_n = tv(draft, target)  # [S]
        r, fallback = residual_chain(target, draft, drafts)  # [S, M], [S, S]
        all_rejected = r.prod(-1)
        out[n] = mu @ tv_n - root @ (tv_n - all_rejected)
        h = np.maximum(target - draft, 0.0)
        root = mu @ h - root @ (h - all_rejected[:, None] * fallback)
        mu = mu @ target
    return out


def expected_rejections_batch(chain: MarkovChain, drafts: int) -> float:
    """Theorem 3 (2): expected rejections of batch SD with `drafts` i.i.d. drafts per round.
    `drafts = 1` is Theorem 1 exactly."""
    return float(rejections_per_position_batch(chain, drafts).sum())


def expected_rejections_batch_limit(chain: MarkovChain) -> float:
    """Proposition 1: `lim_{M→∞} E[N_rej] = Σ_n (E_target TV_n - Ē_{F∞} TV_n)` with
    `F∞' = (mu - F∞) @ (target - draft)_+`: roots never reject, every non-root position still
    rejects with probability TV. Valid when the root rejection `Π_m r_m → 0` (full-support
    draft); with a support gap the finite-M values level off above it (support floor)."""
    mu = chain.initial.copy()
    root = chain.initial.copy()
    total = 0.0
    for n in range(chain.horizon):
        tv_n = tv(chain.draft[n], chain.target[n])
        total += float(mu @ tv_n - root @ tv_n)
        root = (mu - root) @ np.maximum(chain.target[n] - chain.draft[n], 0.0)
        mu = mu @ chain.target[n]
    return total


def sample_batch_sd(
    chain: MarkovChain,
    drafts: int,
    runs: int,
    rng: np.random.Generator,
    prompt: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`runs` independent batch-SD decodes. Returns (tokens [N, T], rejected [N, T]).

    Simulated position by position (all runs at once): at a root, `drafts` i.i.d. first tokens
    are verified against the residual chain; elsewhere the accepted branch's next draft token
    is verified with plain SD. Drawing the accepted branch's continuation lazily is exact: given
    its accepted tokens, the branch continues as a fresh draft chain, independent of the
    discarded branches. `prompt` [N] fixes each run's x_0 (default: drawn from the chain).
    """
    if drafts < 1:
        raise ValueError(f"drafts={drafts}: at least one draft is required")
    if prompt is None:
        prompt = draw_rows(np.broadcast_to(chain.initial, (runs, chain.states)), rng)
    state = np.asarray(prompt, dtype=np.int64)
    is_root = np.ones(runs, dtype=bool)
    tokens = np.empty((runs, chain.horizon), dtype=np.int64)
    rejected = np.empty((runs, chain.horizon), dtype=bool)
    for n in range(chain.horizon):
        draft, target = chain.draft[n][state], chain.target[n][state]
        current = target.copy()
        accepted = np.zeros(runs, dtype=bool)
        emitted = np.zeros(runs, dtype=np.int64)
        for m in range(drafts):
            tries = ~accepted & (is_root | (m == 0))  # non-roots verify a single draft
            proposal = draw_rows(draft, rng)
            ok = tries & (rng.random(runs) * take(draft, proposal) < take(current, proposal))
            emitted = np.where(ok, proposal, emitted)
            accepted |= ok
            step = tries & ~ok
            current = np.where(step[:, None], residual(current, draft)[0], current)
        fallback = draw_rows(current, rng)
        state = np.where(accepted, emitted, fallback)
        tokens[:, n], rejected[:, n] = state, ~accepted
        is_root = ~accepted
    return tokens, rejected
