"""The tensor-parallel group on a real local Ray (issue 5): 2 rank actors in a placement group
give TP=1's forest logits within 1e-5 through a recorded DSBD decode (compaction and session
handles included), free every cache handle they are told to, refuse an uneven split before
starting any rank, run on cpu with no GPU visible and the group timeout asked for, keep the
rendezvous file while serving, and when a rank is killed the next call fails within seconds,
the health check fails, no rank is left running and the rendezvous file is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.replicas.tp_group import TensorParallelBroken, TensorParallelScorer, actor_device

REPO = Path(__file__).parents[2]


def test_group_on_ray(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.tp_ray_checks", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    line = next(x for x in completed.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    # tp_size=3 on 4 heads, 2 KV heads: 1 and 2 split both (4 would not split the KV heads)
    assert "num_attention_heads=4" in result["uneven"] and "one of [1, 2] for" in result["uneven"]
    assert result["max_difference"] < 1e-5
    # every rank stores one cache per session still decoding at the end (how many are depends
    # on the recorded decode's draws; at least one, and none once discarded)
    exported = result["exported"]
    assert exported >= 1 and result["stored_after_export"] == [exported, exported]
    assert result["stored_after_discard"] == [0, 0]
    assert (
        result["ranks"]
        == [
            {
                "device": "cpu",
                "shard_devices": ["cpu"],
                "cuda_initialized": False,
                "cuda_visible_devices": "",
                "group_timeout_s": 900.0,
            }
        ]
        * 2
    )
    assert result["store_kept_while_serving"] is True
    assert "rank 1 failed" in result["after_kill"]
    assert result["fail_seconds"] < 10
    assert "broken" in result["health_after_kill"]
    assert result["ranks_alive"] == []
    assert result["store_left_after_shutdown"] is False


def test_a_rank_uses_the_device_ray_gave_it() -> None:
    assert actor_device("cpu", [], None) == "cpu"
    assert actor_device("cpu", [], "0,1") == "cpu"  # the worker hides those GPUs itself
    assert actor_device("cuda", [3], "3") == "cuda:0"  # Ray's GPU, the only one visible
    for gpu_ids, visible in [([3], None), ([3], "0,1,2,3"), ([], ""), ([0, 1], "0,1")]:
        with pytest.raises(TensorParallelBroken, match=r"ray.get_gpu_ids\(\)=.*CUDA_VISIBLE"):
            actor_device("cuda", gpu_ids, visible)


def test_init_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"init_timeout_s=0: must be > 0 seconds"):
        TensorParallelScorer("smollm2", tp_size=2, init_timeout_s=0)
