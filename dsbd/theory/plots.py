"""Matplotlib figures of `dsbd theory simulate` (imported only when plots are requested).

Why separate: plotting is presentation, the numbers come from `simulate`; keeping matplotlib
out of the formulas keeps `dsbd.theory` importable (and testable) without a display
stack.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _running_panel(ax, block: dict, label: str, color: str) -> None:
    mean, se = block["running_mean"], block["running_se"]
    n = np.arange(1, len(mean) + 1)
    start = min(20, len(mean) - 1)  # the first few running SEs are meaningless
    ax.plot(n[start:], mean[start:], color=color, lw=1.2, label=f"{label}: Monte Carlo mean")
    ax.fill_between(
        n[start:],
        (mean - 2 * se)[start:],
        (mean + 2 * se)[start:],
        color=color,
        alpha=0.2,
        label="±2 standard errors",
    )
    ax.axhline(block["theory"], color="k", ls="--", lw=1, label=f"{label}: theory")
    ax.set_xscale("log")
    ax.set_xlabel("number of runs")
    ax.set_ylabel("rejections per decode")


def sd_figure(path: Path, settings, rejections: dict) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    block = rejections["sd"]
    _running_panel(ax, block, "SD", "tab:blue")
    ax.set_title(
        f"SD on a random {settings.states}-state chain, T={settings.horizon}: "
        f"Theorem 1 = {block['theory']:.2f}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def batch_figure(path: Path, settings, rejections: dict) -> Path:
    plt = _pyplot()
    blocks = rejections["batch"]
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.2 * len(blocks), 3.8), squeeze=False)
    colors = ("tab:orange", "tab:green", "tab:red", "tab:purple")
    for ax, (m, block), color in zip(axes[0], blocks.items(), colors, strict=False):
        _running_panel(ax, block, f"M={m}", color)
        ax.set_title(f"batch SD, M={m}: Theorem 3 = {block['theory']:.2f}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_figure(path: Path, settings, rejections: dict) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drafts = sorted(rejections["sweep"])
    ax.plot(drafts, [rejections["sweep"][m] for m in drafts], "o-", label="Theorem 3")
    mc = {1: rejections["sd"], **rejections["batch"]}
    ax.errorbar(
        list(mc),
        [b["mc_mean"] for b in mc.values()],
        yerr=[2 * b["mc_standard_error"] for b in mc.values()],
        fmt="s",
        color="tab:red",
        ms=4,
        capsize=3,
        label="Monte Carlo ±2 SE",
    )
    ax.axhline(rejections["limit"], color="k", ls="--", label="Proposition 1 limit (M→∞)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("drafts per round M")
    ax.set_ylabel("expected rejections")
    ax.set_title(f"Rejections vs M (T={settings.horizon}): diminishing returns, positive floor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def improvement_figure(path: Path, improvement: dict) -> Path:
    plt = _pyplot()
    drafts = improvement["drafts"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for u, curve in improvement["bernoulli"].items():
        axes[0].plot(drafts, curve["closed"], label=f"draft Ber({u})")
        axes[0].axhline(u - 0.5, color="grey", lw=0.5, ls=":")
    axes[0].set_title("BI_M, target Ber(0.5): (u-v)(1-u^(M-1)) → TV")
    for ratio, curve in improvement["uniform"].items():
        axes[1].plot(drafts, curve["closed"], label=f"V/V' = {ratio:g}")
    axes[1].set_title("BI_M, draft Unif(V), target Unif(V'): → 1-1/r")
    for ax in axes:
        ax.set_xlabel("drafts M")
        ax.set_ylabel("root rejection saved")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_figure(path: Path, pareto: dict) -> Path:
    plt = _pyplot()
    panels = [("single_step", "one position (random 7-token pair)")]
    panels += [
        (k, f"{k.replace('_', ' ')}: Σ over positions") for k in pareto if k != "single_step"
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        data = pareto[key]
        opt, uno = data["opt"], data["uno"]
        front = data["tv"] if key == "single_step" else opt[0]["front"]
        ax.fill_between([0, front], [front, 0], [0, 0], color="0.9", label="unattainable")
        ax.plot([front, 0], [0, front], "k-", lw=1, label="Pareto front R + bias = TV")
        ax.plot(
            [p["rejections"] for p in opt],
            [p["bias"] for p in opt],
            "o",
            ms=4,
            label="Decoding-OPT",
        )
        ax.plot(
            [p["rejections"] for p in uno],
            [p["bias"] for p in uno],
            "x",
            ms=5,
            label="Decoding-UNO",
        )
        ax.set_xlabel("rejection probability" if key == "single_step" else "expected rejections")
        ax.set_ylabel("least bias (TV)" if key == "single_step" else "Σ per-position bias")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("ε over-acceptance: OPT on the front, UNO above it (Theorems 4-5)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(out_dir: Path, settings, rejections: dict, improvement: dict, pareto: dict):
    """Every figure; returns the written paths."""
    return [
        sd_figure(out_dir / "sd_rejections.png", settings, rejections),
        batch_figure(out_dir / "batch_rejections.png", settings, rejections),
        sweep_figure(out_dir / "rejections_vs_drafts.png", settings, rejections),
        improvement_figure(out_dir / "batch_improvement.png", improvement),
        pareto_figure(out_dir / "pareto_front.png", pareto),
    ]
