"""The statistical harness of the exactness tests: do samples look like i.i.d. draws from an
exactly known distribution (ALGORITHM.md §12.1)?

Split from tests/support/exact_reference.py (which re-exports these names), with which it shares the
rule: plain Python + numpy, no import of ``dsbd_core``, small enough to audit by reading.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def empirical(samples: Sequence[Hashable]) -> dict[Hashable, float]:
    """Relative frequencies of the samples."""
    n = len(samples)
    if n == 0:
        raise ValueError("no samples")
    return {k: c / n for k, c in Counter(samples).items()}


def tv(p: dict, q: dict) -> float:
    """Total-variation distance between two distributions given as dicts (missing = 0)."""
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


_NULL_CACHE: dict[tuple, float] = {}


def null_tv_quantile(
    exact: dict, n: int, q: float = 0.999, reps: int = 2000, seed: int = 0
) -> float:
    """``q``-quantile of TV(exact, empirical of ``n`` i.i.d. draws from ``exact``).

    Why: with many outcomes the empirical TV of a *correct* sampler is far from 0 and depends
    on ``n`` and on the shape of ``exact``; the null distribution at the same ``n`` is the fair
    threshold (ALGORITHM.md §12.1). Vectorised with multinomial counts (``reps x len(exact)``) and
    memoised, because several assertions may share one exact distribution.
    """
    # Descending order: numpy's multinomial draws conditional binomials category by category,
    # which is cheaper once the remaining count is small (about 1.6x faster here).
    probs = np.array(sorted(exact.values(), reverse=True), dtype=np.float64)
    key = (tuple(probs.tolist()), n, q, reps, seed)
    if key not in _NULL_CACHE:
        probs = probs / probs.sum()
        rng = np.random.default_rng(seed)
        # Chunks of reps bound the memory of the reps x outcomes count matrix (~160 MB).
        chunk = max(1, 20_000_000 // len(probs))
        distances = []
        for start in range(0, reps, chunk):
            counts = rng.multinomial(n, probs, size=min(chunk, reps - start))
            distances.append(0.5 * np.abs(counts / n - probs).sum(axis=1))
        _NULL_CACHE[key] = float(np.quantile(np.concatenate(distances), q))
    return _NULL_CACHE[key]


def assert_matches(samples: Sequence[Hashable], exact: dict, label: str) -> tuple[float, float]:
    """Fail unless ``samples`` look like i.i.d. draws from ``exact``; return (TV, threshold).

    Two checks: (1) every sample lies in the support of ``exact`` — an impossible outcome is a
    bug however rare; (2) TV(empirical, exact) must not exceed the 0.999 null quantile at the
    same sample size. The message names the worst outcomes so a failure can be diagnosed.
    """
    n = len(samples)
    emp = empirical(samples)
    impossible = [k for k in emp if exact.get(k, 0.0) <= 0.0]
    if impossible:
        shown = ", ".join(f"{k!r} (x{round(emp[k] * n)})" for k in impossible[:5])
        raise AssertionError(
            f"[{label}] {len(impossible)} sampled outcome(s) have zero exact probability "
            f"(n={n}): {shown}"
        )
    distance = tv(emp, exact)
    threshold = null_tv_quantile(exact, n, 0.999)
    if distance > threshold:
        keys = set(emp) | set(exact)
        worst = sorted(keys, key=lambda k: -abs(emp.get(k, 0.0) - exact.get(k, 0.0)))[:5]
        lines = "\n".join(
            f"    {k!r}: empirical {emp.get(k, 0.0):.5f}  exact {exact.get(k, 0.0):.5f}  "
            f"diff {emp.get(k, 0.0) - exact.get(k, 0.0):+.5f}"
            for k in worst
        )
        raise AssertionError(
            f"[{label}] TV(empirical, exact) = {distance:.5f} > null 0.999-quantile "
            f"{threshold:.5f} (n={n}, {len(exact)} outcomes); largest deviations:\n{lines}"
        )
    return distance, threshold
