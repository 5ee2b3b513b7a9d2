"""Theorem 1: expected rejections of speculative decoding along a Markov chain (THEORY.md §2).

Why: Theorem 1 says SD's number of rejections — the paper's cost model, one target call per
rejection with unlimited lookahead — has expectation `Σ_n E_{prefix ~ target} TV(draft_n,
target_n)`, and that SD's output law is exactly the target's. The exact recursion gives the
number a deployment can plan with; the vectorised sampler is the independent check (Monte Carlo
and exactness tests) and drives the `dsbd theory simulate` figures.
"""

from __future__ import annotations

import numpy as np

from dsbd.theory.chains import MarkovChain
from dsbd.theory.distributions import residual, tv
from dsbd.theory.sampling import draw_rows, take


def rejections_per_position_sd(chain: MarkovChain) -> np.ndarray:
    """`[T]`: `E_{x_{<n} ~ target}[TV(draft_n, target_n)]`, the rejection probability of
    position n. The prefix law is propagated with the TARGET transitions, never the draft's."""
    per_state = tv(chain.draft, chain.target)  # [T, S]
    return (chain.target_prefix_laws() * per_state).sum(-1)


def expected_rejections_sd(chain: MarkovChain) -> float:
    """Theorem 1: `E[N_rej] = Σ_n E_{x_{<n} ~ target}[TV(draft_n, target_n)]`."""
    return float(rejections_per_position_sd(chain).sum())


def expected_calls_sd(chain: MarkovChain) -> float:
    """Target calls with unlimited lookahead: `1 + Σ_{n<T} E[R_n]` (THEORY.md §1.2, derived
    off-by-one: a rejection at the last position needs no further call)."""
    return 1.0 + float(rejections_per_position_sd(chain)[:-1].sum())


def sample_sd(
    chain: MarkovChain, runs: int, rng: np.random.Generator, prompt: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`runs` independent SD decodes (Algorithm 1). Returns (tokens [N, T], rejected [N, T]).

    Per position: draft x ~ draft_n(·|s), accept with min(1, target/draft), otherwise draw from
    the residual `norm((target_n - draft_n)_+)` and count a rejection. With unlimited lookahead
    the draft's continuation after an accepted token is again drawn from the draft given that
    token, so drawing it lazily, position by position, is the same process. `prompt` [N]
    fixes each run's x_0 (default: drawn from `chain.initial`).
    """
    if prompt is None:
        prompt = draw_rows(np.broadcast_to(chain.initial, (runs, chain.states)), rng)
    state = np.asarray(prompt, dtype=np.int64)
    tokens = np.empty((runs, chain.horizon), dtype=np.int64)
    rejected = np.empty((runs, chain.horizon), dtype=bool)
    for n in range(chain.horizon):
        draft, target = chain.draft[n][state], chain.target[n][state]
        proposal = draw_rows(draft, rng)
        accept = rng.random(runs) * take(draft, proposal) < take(target, proposal)
        fallback = draw_rows(residual(target, draft)[0], rng)
        state = np.where(accept, proposal, fallback)
        tokens[:, n], rejected[:, n] = state, ~accept
    return tokens, rejected


def mean_and_standard_error(values: np.ndarray) -> tuple[float, float]:
    """Monte-Carlo mean and its standard error `sd / sqrt(N)` (THEORY.md §8.0 convention)."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))
