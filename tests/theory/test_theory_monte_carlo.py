"""Theorems 1 and 3 against simulation and against exact enumeration (THEORY.md §8.2, P2-P5,
P8, P9).

Monte Carlo: fixed seeds, pass if |mean - theory| <= 4 standard errors (false alarm ~6e-5).
Enumeration: the exact output law of SD and batch SD is computed by enumerating every draft
token and every accept/reject event of the algorithm, with code that shares nothing with
`dsbd.theory`, and compared with the target's sequence law to 1e-12 — unbiasedness with
no statistics at all, and an independent check of the Theorem-3 recursion.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import numpy as np
import pytest

from dsbd.theory import (
    MarkovChain,
    expected_rejections_batch,
    expected_rejections_sd,
    random_chain,
    sample_batch_sd,
    sample_sd,
    tv,
)
from dsbd.theory.sd import mean_and_standard_error
from tests.support.exact_reference import assert_matches

RUNS = 20_000


def mc_chain() -> MarkovChain:
    return random_chain(np.random.default_rng(0), 5, 10, concentration=0.6, draft_noise=1.0)


def assert_within_4_se(values: np.ndarray, theory: float, label: str) -> None:
    mean, se = mean_and_standard_error(values)
    assert abs(mean - theory) <= 4 * se, f"{label}: MC {mean:.4f} ± {se:.4f} vs theory {theory:.4f}"


def first_two_law(chain: MarkovChain) -> dict[tuple[int, int], float]:
    law = chain.initial @ chain.target[0]
    return {
        (a, b): float(law[a] * chain.target[1][a, b])
        for a, b in itertools.product(range(chain.states), repeat=2)
        if law[a] * chain.target[1][a, b] > 0
    }


def test_theorem1_matches_monte_carlo_and_sd_is_exact() -> None:
    """P2, P3, P5: mean rejections, law of the first two tokens, and the compensator identity
    E[N_rej - Σ_n TV_n(realised prefix)] = 0."""
    chain = mc_chain()
    rng = np.random.default_rng(1)
    prompt = rng.choice(chain.states, size=RUNS, p=chain.initial)
    tokens, rejected = sample_sd(chain, RUNS, rng, prompt=prompt)
    assert_within_4_se(rejected.sum(1), expected_rejections_sd(chain), "Theorem 1")
    assert_matches([tuple(t) for t in tokens[:, :2].tolist()], first_two_law(chain), "SD law")
    previous = np.concatenate([prompt[:, None], tokens[:, :-1]], axis=1)  # x_{n-1} per position
    tv_rows = tv(chain.draft, chain.target)  # [T, S]
    compensator = tv_rows[np.arange(chain.horizon)[None, :], previous].sum(1)
    assert_within_4_se(rejected.sum(1) - compensator, 0.0, "compensator")
    # the compensator is the less noisy predictor of rejections (THEORY.md §8.2, P5: usual, not
    # a theorem)
    assert compensator.var() < rejected.sum(1).var()


@pytest.mark.parametrize("drafts", [2, 3, 4, 5])
def test_theorem3_matches_monte_carlo_and_batch_sd_is_exact(drafts: int) -> None:
    """P8, P9 for M = 2..5."""
    chain = mc_chain()
    tokens, rejected = sample_batch_sd(chain, drafts, RUNS, np.random.default_rng(10 + drafts))
    assert_within_4_se(rejected.sum(1), expected_rejections_batch(chain, drafts), f"M={drafts}")
    samples = [tuple(t) for t in tokens[:, :2].tolist()]
    assert_matches(samples, first_two_law(chain), f"batch SD law M={drafts}")


# ------------------------------------------------------------------------------- enumeration
def enumerate_verification(target: np.ndarray, draft: np.ndarray, drafts: int):
    """Every outcome of verifying `drafts` i.i.d. draft tokens against the residual chain:
    list of (emitted token, probability, rejected?). Independent plain-Python code."""
    outcomes = []

    def stage(m: int, current: np.ndarray, reach: float) -> None:
        if m == drafts:
            for x, px in enumerate(current):
                if reach * px > 0:
                    outcomes.append((x, reach * px, True))
            return
        rest = np.maximum(current - draft, 0.0)
        after = rest / rest.sum() if rest.sum() > 0 else current
        for d, pd in enumerate(draft):
            if pd == 0:
                continue
            accept = min(1.0, current[d] / pd)
            outcomes.append((d, reach * pd * accept, False))
            if accept < 1.0:
                stage(m + 1, after, reach * pd * (1.0 - accept))

    stage(0, target, 1.0)
    return outcomes


def enumerate_batch_sd(chain: MarkovChain, drafts: int) -> tuple[dict, float]:
    """Exact law of (x_1..x_T) and E[N_rej] of batch SD (SD when drafts = 1): a root (first
    position, or right after a rejection) verifies `drafts` drafts, other positions one."""
    states = defaultdict(float)  # (tokens so far, previous token, is root) -> probability
    for x0, p in enumerate(chain.initial):
        if p > 0:
            states[((), x0, True)] += p
    expected_rejections = 0.0
    for n in range(chain.horizon):
        nxt = defaultdict(float)
        for (seq, prev, root), p in states.items():
            m = drafts if root else 1
            for x, q, rejected in enumerate_verification(
                chain.target[n][prev], chain.draft[n][prev], m
            ):
                nxt[(seq + (x,), x, rejected)] += p * q
                expected_rejections += p * q * rejected
        states = nxt
    law = Counter()
    for (seq, _, _), p in states.items():
        law[seq] += p
    return dict(law), expected_rejections


def sparse_chain(seed: int, states: int = 3, horizon: int = 4) -> MarkovChain:
    """A random chain whose draft misses some target tokens (support gaps) and vice versa."""
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.ones(states), size=(horizon, states))
    draft = rng.dirichlet(np.ones(states), size=(horizon, states))
    for rows in (target, draft):
        zero = rng.random(rows.shape) < 0.25
        zero[..., 0] = False
        rows[zero] = 0.0
        rows /= rows.sum(-1, keepdims=True)
    return MarkovChain(draft=draft, target=target, initial=rng.dirichlet(np.ones(states)))


@pytest.mark.parametrize("drafts", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sd_and_batch_sd_are_exactly_unbiased_by_enumeration(drafts: int, seed: int) -> None:
    chain = sparse_chain(seed)
    law, rejections = enumerate_batch_sd(chain, drafts)
    for seq in itertools.product(range(chain.states), repeat=chain.horizon):
        exact = sum(
            chain.initial[x0]
            * np.prod([chain.target[n][([x0, *seq])[n], seq[n]] for n in range(chain.horizon)])
            for x0 in range(chain.states)
        )
        assert abs(law.get(seq, 0.0) - exact) < 1e-12, seq
    assert abs(rejections - expected_rejections_batch(chain, drafts)) < 1e-12
