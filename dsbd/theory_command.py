"""`dsbd theory simulate`: the speculative-decoding theory simulations (Yin et al. 2024).

    dsbd theory simulate --out theory-out

The simulation itself is dsbd.theory.simulate; here only the flags, their checks
(exit 2 naming the flag) and the printed summary.
"""

from __future__ import annotations

import argparse

from dsbd.common import fail


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd theory` and `dsbd theory simulate`."""
    theory = commands.add_parser("theory", help="speculative-decoding theory (Yin et al. 2024)")
    theory_commands = theory.add_subparsers(dest="theory_command", required=True)
    simulate = theory_commands.add_parser(
        "simulate",
        help="reproduce the paper's simulations on random Markov chains: PNG plots + JSON",
        description="Empirical vs theoretical rejections of SD and batch SD, rejections vs the "
        "number of drafts M, batch-improvement curves and the rejection/bias Pareto front "
        "(Decoding-OPT vs Decoding-UNO). Writes simulation.json and *.png into --out.",
    )
    simulate.add_argument("--out", default="theory-simulation", help="output directory")
    simulate.add_argument("--seed", type=int, default=10, help="default: 10 (as the paper)")
    simulate.add_argument("--states", type=int, default=7, help="chain states; default: 7")
    simulate.add_argument("--horizon", type=int, default=50, help="tokens T; default: 50")
    simulate.add_argument("--runs", type=int, default=10_000, help="Monte-Carlo runs per curve")
    simulate.add_argument(
        "--drafts", type=int, nargs="+", default=[2, 4, 5], help="batch sizes M to simulate"
    )
    simulate.add_argument("--no-plots", action="store_true", help="JSON only (no matplotlib)")


def run(args: argparse.Namespace) -> int:
    """`dsbd theory simulate`: check the flags, run the simulations, print the summary."""
    from pathlib import Path

    from dsbd.theory.simulate import SimulationSettings, run_simulation

    for name in ("states", "horizon", "runs"):
        if getattr(args, name) < 2:
            return fail(f"--{name}={getattr(args, name)}: at least 2")
    if min(args.drafts) < 1:
        return fail(f"--drafts {args.drafts}: every M must be >= 1")
    settings = SimulationSettings(
        seed=args.seed,
        states=args.states,
        horizon=args.horizon,
        runs=args.runs,
        batch_drafts=tuple(args.drafts),
    )
    out = Path(args.out)
    summary = run_simulation(out, settings, plots=not args.no_plots)
    sd = summary["sd"]
    print(
        f"SD: Theorem 1 {sd['theory']:.3f}, "
        f"Monte Carlo {sd['mc_mean']:.3f} ± {sd['mc_standard_error']:.3f}"
    )
    for m, block in summary["batch"].items():
        print(
            f"batch SD M={m}: Theorem 3 {block['theory']:.3f}, "
            f"Monte Carlo {block['mc_mean']:.3f} ± {block['mc_standard_error']:.3f}"
        )
    print(f"Proposition 1 limit (M -> inf): {summary['proposition1_limit']:.3f}")
    print(f"wrote {out / 'simulation.json'}" + "".join(f", {p}" for p in summary["plots"]))
    return 0
