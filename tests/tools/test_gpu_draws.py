"""benchmarks/gpu/gpu_draws.py on the CPU with the device's branches forced: the check a lent GPU
runs (the same tokens on the host and on the device, through the verify graph too) works here,
and its report says so."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gpu_draws.py"


@pytest.mark.slow
def test_the_gpu_draw_check_runs_and_finds_the_same_tokens(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_draws", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "draws.json"
    assert module.main(["--device", "cpu", "--cases", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_same"] and report["uniforms_bitwise_equal"] == {
        "float32": True,
        "float64": True,
    }
    assert [c["method"] for c in report["cases"]] == ["dsbd", "beam", "spec_beam_search"]
