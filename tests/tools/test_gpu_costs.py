"""benchmarks/gpu/gpu_costs.py on the tiny pair on CPU: the report a GPU run would write.

The script is meant for a GPU nobody here has had; this runs its whole path (engine iterations
timed per ScoreCall, acceptance read from result files, the modelled speedup, JSON + markdown)
in about a second, so a GPU session finds it working.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gpu_costs.py"


@pytest.fixture(scope="module")
def gpu_costs():
    spec = importlib.util.spec_from_file_location("gpu_costs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_costs"] = module  # its dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_costs"]


@pytest.mark.slow
def test_tiny_cpu_run_writes_costs_and_modelled_speedups(gpu_costs, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "qwen_pair_acceptance.json").write_text(json.dumps({"overall": {"acceptance": 0.8}}))
    out = tmp_path / "costs.json"
    argv = [
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--widths",
        "1",
        "2",
        "--gammas",
        "1",
        "2",
        "--contexts",
        "16",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--results",
        str(results),
        "--out",
        str(out),
        "--no-progress",
    ]
    report = gpu_costs.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for key in (
        "formula",
        "settings",
        "machine",
        "versions",
        "models",
        "costs",
        "modelled",
        "measured_gpu",
        "acceptance_sources",
        "notes",
    ):
        assert key in report
    assert report["settings"]["dtype"] == "float32"
    assert report["models"]["target"]["config"]["hidden_size"] == 128
    assert report["versions"]["torch"]

    beams, dsbd = report["costs"]["beam"], report["costs"]["dsbd"]
    assert [(b["width"]) for b in beams] == [1, 2]
    assert [(c["width"], c["gamma"]) for c in dsbd] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for beam in beams:
        assert beam["beam_step_ms"] > 0 and beam["iterations"] == 2
        # a beam step feeds each beam's last token: the KV cache was compacted, not rebuilt
        assert (beam["rows"], beam["tokens_per_row"]) == (beam["width"], 1)
    for cost in dsbd:
        assert cost["draft_root_ms"] > 0 and cost["verify_ms"] > 0
        assert cost["draft_iteration_ms"] >= cost["draft_root_ms"]
        assert (cost["draft_layer_ms"] is None) == (cost["gamma"] == 1)
        # one query row per root tree, or (packed_forward) the forests packed into one row
        assert cost["verify_rows"] in (1, cost["width"])
        fed = cost["verify_rows"] * cost["verify_tokens_per_row"]
        assert 2 * cost["width"] <= fed <= cost["width"] * (1 + cost["width"] * cost["gamma"])

    # SpS rows from alpha = 0.8 at W = 1, gamma 1 and 2, each with the documented formula
    modelled = report["modelled"]
    assert [(m["method"], m["kind"]) for m in modelled] == [
        ("sps-g1", "modelled"),
        ("sps-g2", "modelled"),
    ]
    for m, e in zip(modelled, (1.8, 1 + 0.8 + 0.64), strict=True):
        assert m["tokens_per_iteration"] == pytest.approx(e)
        assert m["speedup"] == pytest.approx(
            e * m["t_beam_ms"] / (m["t_draft_ms"] + m["t_verify_ms"])
        )
        assert m["speedup_with_host"] > 0
    assert report["measured_gpu"] == []
    table = out.with_suffix(".md").read_text()
    assert "(modelled)" in table and "Directly measured GPU figures" in table


def test_every_size_builds_its_architecture_and_says_what_its_figures_are(gpu_costs) -> None:
    """The qwen shapes build a Qwen2 model (on the meta device: no memory), and every size has
    its note in the report, so a GPU session's `--size qwen` run cannot fail on either."""
    import torch

    from benchmarks.gpu.gpu_costs_models import SIZES, model_config

    assert set(gpu_costs.SIZE_NOTES) == set(SIZES)
    for size, pair in SIZES.items():
        for role, shape in pair.items():
            config = model_config(shape)
            assert config.model_type == ("qwen2" if size == "qwen" else "llama"), (size, role)
    model = gpu_costs.build_model(SIZES["qwen"]["target"], torch.device("meta"), torch.bfloat16)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.54e9, rel=0.01)
