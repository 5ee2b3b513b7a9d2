"""Checks of `deployments.replicas.tp_group` on a real local Ray, run as a subprocess by
tests/serving/test_tp_group.py (Ray changes HOME and other environment of the process that starts
it).

    python -m tests.support.tp_ray_checks WORK_DIR   -> prints one JSON line "RESULT {...}"
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.support.tp_harness import max_difference, record_decode, save_tiny


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main(work: Path) -> dict:
    target = save_tiny("qwen2", work / "target")
    draft = save_tiny("qwen2", work / "draft", seed=4)
    script, want = record_decode(target, draft)

    from deployments.local_ray import start_local_ray, stop_local_ray
    from deployments.replicas.tp_group import TensorParallelBroken, TensorParallelScorer
    from dsbd_core.models.tensor_parallel import TensorParallelError

    start_local_ray(num_cpus=4)
    result: dict = {}
    try:
        try:
            TensorParallelScorer(str(target), tp_size=3)
        except TensorParallelError as error:
            result["uneven"] = str(error)
        scorer = TensorParallelScorer(str(target), tp_size=2, init_timeout_s=900.0)
        result["pids"] = scorer.pids
        result["ranks"] = [
            {
                k: info[k]
                for k in (
                    "device",
                    "shard_devices",
                    "cuda_initialized",
                    "cuda_visible_devices",
                    "group_timeout_s",
                )
            }
            for info in scorer.rank_infos
        ]
        store_dir = Path(scorer.store.removeprefix("file://")).parent
        got = []
        for kind, args in script:
            if kind == "round_trip":
                scorer.import_sessions(scorer.export_sessions())
            elif kind == "set_roots":
                scorer.set_roots(*args)
            else:
                got.append(scorer.forward(args[0]))
        result["max_difference"] = max_difference(got, want)
        handles = scorer.export_sessions()
        result["exported"] = sum(handle is not None for handle in handles)
        result["stored_after_export"] = scorer.stored()
        scorer.discard_sessions(handles)
        result["stored_after_discard"] = scorer.stored()
        scorer.check()
        result["store_kept_while_serving"] = store_dir.is_dir()

        # A rank dies: the next call fails fast, health fails, no rank is left running.
        os.kill(scorer.pids[1], signal.SIGKILL)
        start = time.monotonic()
        try:
            scorer.set_roots(*next(args for kind, args in script if kind == "set_roots"))
            scorer.forward([])
            result["after_kill"] = "no error"
        except TensorParallelBroken as error:
            result["after_kill"] = str(error)
        result["fail_seconds"] = time.monotonic() - start
        try:
            scorer.check()
            result["health_after_kill"] = "healthy"
        except TensorParallelBroken as error:
            result["health_after_kill"] = str(error)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in scorer.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        result["ranks_alive"] = [p for p in scorer.pids if _alive(p)]
        result["store_left_after_shutdown"] = store_dir.exists()
    finally:
        stop_local_ray()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
