"""The tensor-parallel group on a real local Ray (issue 5): 2 rank actors in a placement group
give TP=1's forest logits within 1e-5 through a recorded DSBD decode (compaction and session
handles included), free every cache handle they are told to, refuse an uneven split before
starting any rank, and when a rank is killed the next call fails within seconds, the health
check fails, and no rank is left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parent.parent


def test_group_on_ray(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.tp_ray_checks", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    line = next(x for x in completed.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert "num_attention_heads=4" in result["uneven"] and "[1, 2, 4]" in result["uneven"]
    assert result["max_difference"] < 1e-5
    assert result["stored_after_export"] == [2, 2]
    assert result["stored_after_discard"] == [0, 0]
    assert "rank 1 failed" in result["after_kill"]
    assert result["fail_seconds"] < 10
    assert "broken" in result["health_after_kill"]
    assert result["ranks_alive"] == []
