"""`dsbd theory simulate`: the paper's simulations on random Markov chains (THEORY.md §6.4).

Why: the figures are the quickest way to see (and re-check after any change) that the formulas
in this package match simulation — empirical vs theoretical rejections for SD (Figure 2a) and
batch SD (2b), rejections vs the number of drafts M with Proposition 1's floor (2c), the batch
improvement curves (Figure 3), and the rejection/bias Pareto front with Decoding-OPT on it and
Decoding-UNO above it (Figure 4). Writes `simulation.json` and PNG plots to one directory;
docs/THEORY.md reads the committed copies.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from dsbd.theory.batch import (
    expected_rejections_batch,
    expected_rejections_batch_limit,
    sample_batch_sd,
)
from dsbd.theory.chains import MarkovChain, random_chain
from dsbd.theory.distributions import (
    batch_improvement,
    bernoulli_batch_improvement,
    tv,
    uniform_batch_improvement,
)
from dsbd.theory.overaccept import (
    overaccept_chain,
    overaccept_rejection,
    overaccept_step_law,
)
from dsbd.theory.sd import expected_rejections_sd, mean_and_standard_error, sample_sd

M_SWEEP = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128)


@dataclass(frozen=True)
class SimulationSettings:
    """What `dsbd theory simulate` runs (defaults: the paper's setting, 7 states, T = 50)."""

    seed: int = 10
    states: int = 7
    horizon: int = 50
    runs: int = 10_000
    batch_drafts: tuple[int, ...] = (2, 4, 5)
    draft_noise: float = 0.7  # chain A (Figures 2, 4b); about a third of positions rejected
    draft_noise_b: float = 0.4  # chain B (Figure 4c): a closer draft
    epsilons: int = 21  # grid points of ε in the Pareto figure


def _running(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running mean and standard error after 1..N runs."""
    n = np.arange(1, len(values) + 1)
    mean = np.cumsum(values) / n
    second = np.cumsum(values**2) / n
    var = np.maximum(second - mean**2, 0.0) * n / np.maximum(n - 1, 1)
    return mean, np.sqrt(var / n)


def _thin(x: np.ndarray, points: int = 60) -> list[float]:
    """Log-spaced samples of a running curve for the JSON (the full curve is in the plot)."""
    idx = np.unique(np.geomspace(1, len(x), points).astype(int)) - 1
    return [float(v) for v in x[idx]]


def _mc_block(theory: float, rejections: np.ndarray) -> dict:
    mean, se = mean_and_standard_error(rejections)
    running, running_se = _running(rejections)
    return {
        "theory": theory,
        "mc_mean": mean,
        "mc_standard_error": se,
        "z": (mean - theory) / se if se > 0 else 0.0,
        "running_mean": running,
        "running_se": running_se,
    }


def simulate_rejections(chain: MarkovChain, settings: SimulationSettings, rng) -> dict:
    """Figure 2: SD and batch SD, Monte Carlo against Theorems 1 and 3, and the M sweep."""
    _, rejected = sample_sd(chain, settings.runs, rng)
    sd = _mc_block(expected_rejections_sd(chain), rejected.sum(1).astype(float))
    batch = {}
    for m in settings.batch_drafts:
        _, rejected = sample_batch_sd(chain, m, settings.runs, rng)
        batch[m] = _mc_block(expected_rejections_batch(chain, m), rejected.sum(1).astype(float))
    sweep = {m: expected_rejections_batch(chain, m) for m in M_SWEEP}
    return {
        "sd": sd,
        "batch": batch,
        "sweep": sweep,
        "limit": expected_rejections_batch_limit(chain),
        "acceleration_sd": chain.horizon / sd["theory"],
    }


def batch_improvement_curves(max_drafts: int = 20) -> dict:
    """Figure 3 (right): BI_M vs M for Bernoulli and uniform pairs; closed form and recursion."""
    drafts = np.arange(1, max_drafts + 1)
    bernoulli, uniform = {}, {}
    for u in (0.6, 0.7, 0.8, 0.9):  # draft Ber(u), target Ber(0.5)
        target, draft = np.array([0.5, 0.5]), np.array([1 - u, u])
        bernoulli[u] = {
            "closed": [bernoulli_batch_improvement(u, 0.5, int(m)) for m in drafts],
            "recursion": [float(batch_improvement(target, draft, int(m))) for m in drafts],
        }
    for ratio in (1.5, 2.0, 4.0, 8.0):  # draft Unif(V), target Unif(V / ratio), V = 24
        v = 24
        vp = int(round(v / ratio))
        target = np.zeros(v)
        target[:vp] = 1.0 / vp
        uniform[ratio] = {
            "closed": [uniform_batch_improvement(v / vp, int(m)) for m in drafts],
            "recursion": [
                float(batch_improvement(target, np.full(v, 1.0 / v), int(m))) for m in drafts
            ],
        }
    return {"drafts": drafts.tolist(), "bernoulli": bernoulli, "uniform": uniform}


def pareto_points(chains: dict[str, MarkovChain], epsilons: int, rng) -> dict:
    """Figure 4: the rejection/bias front with Decoding-OPT and Decoding-UNO.

    Single step: a random 7-token pair. Chains: rejections and summed per-position bias with
    prefixes under the target law (overaccept_chain prefix="target": the front is the line
    rejections + bias = Σ_n E TV_n, OPT lies on it, UNO above). The decoder's own-law figures
    (what a run sees; its bias column bounds the sequence TV) are stored alongside.
    """
    target, draft = rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))
    grid = np.linspace(0.0, float(np.max(draft - target)), epsilons)  # R(ε) is linear here
    step = {"tv": float(tv(target, draft)), "epsilon": grid.tolist(), "opt": [], "uno": []}
    for eps in grid:
        for mode in ("opt", "uno"):
            law = overaccept_step_law(target, draft, eps, mode)
            step[mode].append(
                {
                    "rejections": float(overaccept_rejection(target, draft, eps)),
                    "bias": float(tv(law, target)),
                }
            )
    out = {"single_step": step}
    for name, chain in chains.items():
        eps_grid = _epsilon_grid(chain.draft - chain.target, epsilons)
        rows = {"epsilon": eps_grid.tolist()}
        modes: tuple[Literal["opt", "uno"], ...] = ("opt", "uno")
        for mode in modes:
            rows[mode] = [overaccept_chain(chain, e, mode, "target") for e in eps_grid]
            rows[mode + "_own_law"] = [overaccept_chain(chain, e, mode, "own") for e in eps_grid]
        out[name] = rows
    return out


def _epsilon_grid(gaps: np.ndarray, points: int) -> np.ndarray:
    """0 and quantiles of the positive gaps draft - target: spreads the points along the front
    (a uniform grid piles them up near zero rejections when a few gaps are large)."""
    positive = gaps[gaps > 0]
    return np.concatenate([[0.0], np.quantile(positive, np.linspace(0.0, 1.0, points - 1))])


def run_simulation(out_dir: Path, settings: SimulationSettings, plots: bool = True) -> dict:
    """Run everything, write `simulation.json` (+ PNGs) into `out_dir`, return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(settings.seed)
    chain_a = random_chain(rng, settings.states, settings.horizon, draft_noise=settings.draft_noise)
    chain_b = random_chain(
        rng, settings.states, settings.horizon, draft_noise=settings.draft_noise_b
    )
    rejections = simulate_rejections(chain_a, settings, rng)
    improvement = batch_improvement_curves()
    pareto = pareto_points({"chain_a": chain_a, "chain_b": chain_b}, settings.epsilons, rng)
    files = []
    if plots:
        from dsbd.theory import plots as plotting

        files = plotting.write_all(out_dir, settings, rejections, improvement, pareto)
    summary = {
        "settings": asdict(settings),
        "mean_tv_per_position": rejections["sd"]["theory"] / settings.horizon,
        "sd": _strip(rejections["sd"]),
        "batch": {str(m): _strip(b) for m, b in rejections["batch"].items()},
        "rejections_vs_drafts": {str(m): v for m, v in rejections["sweep"].items()},
        "proposition1_limit": rejections["limit"],
        "acceleration_sd": rejections["acceleration_sd"],
        "batch_improvement": improvement,
        "pareto": pareto,
        "plots": [p.name for p in files],
    }
    (out_dir / "simulation.json").write_text(json.dumps(summary, indent=1, default=_jsonable))
    return summary


def _strip(block: dict) -> dict:
    """A Monte-Carlo block for the JSON: scalars plus a log-spaced running mean."""
    out = {k: v for k, v in block.items() if not k.startswith("running")}
    out["running_mean_log_spaced"] = _thin(block["running_mean"])
    return out


def _jsonable(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value)}")
