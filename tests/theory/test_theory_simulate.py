"""`dsbd theory simulate` writes the paper's figures and a JSON whose numbers agree with the
formulas; the other subcommands are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsbd.cli import build_parser, main

PLOTS = {
    "sd_rejections.png",
    "batch_rejections.png",
    "rejections_vs_drafts.png",
    "batch_improvement.png",
    "pareto_front.png",
}


@pytest.mark.slow
def test_simulate_writes_plots_and_consistent_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["theory", "simulate", "--out", str(tmp_path), "--runs", "2000", "--horizon", "8"]
    assert main([*argv, "--states", "4", "--drafts", "2", "3"]) == 0
    assert "Theorem 1" in capsys.readouterr().out
    assert PLOTS <= {p.name for p in tmp_path.iterdir()}
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in PLOTS)
    summary = json.loads((tmp_path / "simulation.json").read_text())
    for block in [summary["sd"], *summary["batch"].values()]:
        assert abs(block["z"]) < 4  # Monte Carlo within 4 SE of Theorems 1 / 3
    sweep = summary["rejections_vs_drafts"]
    assert sweep["1"] == pytest.approx(summary["sd"]["theory"])
    assert summary["proposition1_limit"] <= min(sweep.values()) + 1e-12
    for chain in ("chain_a", "chain_b"):
        for point in summary["pareto"][chain]["opt"]:
            assert point["rejections"] + point["bias"] == pytest.approx(point["front"])


def test_simulate_without_plots_and_bad_arguments(tmp_path: Path) -> None:
    argv = ["theory", "simulate", "--out", str(tmp_path), "--runs", "200", "--horizon", "4"]
    assert main([*argv, "--no-plots"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["simulation.json"]
    assert main([*argv, "--drafts", "0"]) == 2
    assert main([*argv, "--runs", "1"]) == 2


def test_existing_subcommands_still_parse() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "hi"]).command == "generate"
    assert parser.parse_args(["models", "prepare"]).presets
