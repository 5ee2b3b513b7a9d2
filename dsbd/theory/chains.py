"""Markov-chain instances on which the theorems are stated and simulated (THEORY.md §1, §6.4).

Why: the paper's results are about a draft and a target *sequence* model; a time-inhomogeneous
Markov chain (next-token law depends on the previous token and the position) is the smallest
model where prefixes matter, every expectation is computable exactly, and Monte Carlo is cheap.
`MarkovChain` is the one container every formula and sampler of this package takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True)
class MarkovChain:
    """A draft/target pair of time-inhomogeneous Markov chains over `S` states.

    draft[n, s, x]  = draft law of token n+1 given token n = s (position n = 0..T-1);
    target[n, s, x] = the target's; initial[s] = law of the prompt token x_0.
    """

    draft: np.ndarray  # [T, S, S]
    target: np.ndarray  # [T, S, S]
    initial: np.ndarray  # [S]

    def __post_init__(self) -> None:
        for name in ("draft", "target", "initial"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        if self.draft.shape != self.target.shape or self.draft.ndim != 3:
            raise ValueError(
                f"draft {self.draft.shape} and target {self.target.shape}: need [T,S,S]"
            )
        t, s, s2 = self.draft.shape
        if s != s2 or self.initial.shape != (s,):
            raise ValueError(f"need square transitions and initial of shape ({s},)")
        for name in ("draft", "target"):
            rows = getattr(self, name).sum(-1)
            if not np.allclose(rows, 1.0, atol=1e-9) or (getattr(self, name) < 0).any():
                raise ValueError(f"{name}: every row must be a probability distribution")
        if not np.isclose(self.initial.sum(), 1.0, atol=1e-9):
            raise ValueError("initial must be a probability distribution")

    @property
    def horizon(self) -> int:
        """T, the number of generated tokens."""
        return self.draft.shape[0]

    @property
    def states(self) -> int:
        return self.draft.shape[1]

    def target_prefix_laws(self) -> np.ndarray:
        """`[T, S]`: law of the token preceding position n under the TARGET (x_0 for n = 0).

        Theorem 1 averages per-position TV over exactly these laws (the prefix of an unbiased
        decoder is target-distributed)."""
        laws = [self.initial]
        for n in range(self.horizon - 1):
            laws.append(laws[-1] @ self.target[n])
        return np.stack(laws)


def homogeneous_chain(
    draft: ArrayLike, target: ArrayLike, initial: ArrayLike, horizon: int
) -> MarkovChain:
    """The same transition matrices at every position."""
    return MarkovChain(
        draft=np.repeat(np.asarray(draft, dtype=np.float64)[None], horizon, axis=0),
        target=np.repeat(np.asarray(target, dtype=np.float64)[None], horizon, axis=0),
        initial=np.asarray(initial, dtype=np.float64),
    )


def golden_chain() -> MarkovChain:
    """The two-token chain of THEORY.md §8.1 (x_0 = 0, T = 3) with hand-checkable golden values."""
    return homogeneous_chain(
        draft=[[0.8, 0.2], [0.4, 0.6]],
        target=[[0.6, 0.4], [0.3, 0.7]],
        initial=[1.0, 0.0],
        horizon=3,
    )


def random_chain(
    rng: np.random.Generator,
    states: int,
    horizon: int,
    concentration: float = 1.0,
    draft_noise: float = 0.7,
) -> MarkovChain:
    """A random non-stationary instance like the paper's simulations (7 states, uniform prompt).

    Target rows are Dirichlet(`concentration`) draws, fresh at every position. The draft is a
    noisy copy, `(1 - draft_noise) · target + draft_noise · Dirichlet`, so it approximates the
    target as a small model does (`draft_noise = 1`: unrelated chains; 0: identical). The paper's
    own generator is unpublished, so its figures (e.g. 16.41 rejections) are not reproducible
    bit for bit; this generator gives the same regime (about a third of positions rejected).
    """
    if not 0.0 <= draft_noise <= 1.0:
        raise ValueError(f"draft_noise={draft_noise}: allowed 0 <= draft_noise <= 1")
    alpha = np.full(states, concentration)
    target = rng.dirichlet(alpha, size=(horizon, states))
    noise = rng.dirichlet(alpha, size=(horizon, states))
    draft = (1.0 - draft_noise) * target + draft_noise * noise
    return MarkovChain(draft=draft, target=target, initial=np.full(states, 1.0 / states))
