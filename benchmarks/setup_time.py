"""What CI pays before the first test: `scripts/setup.sh` into a new `.venv` and the type check
with an empty cache, for two commits side by side.

Each round clones each commit afresh (as CI does), runs its set-up, then its `mypy` from an
empty cache, and records wall seconds and the CPU seconds of those children; the commits
alternate within a round so that the machine's drift falls on both. Run it alone on the machine:

    .venv/bin/python benchmarks/setup_time.py --commits BASE NEW --rounds 2 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dsbd_core.models.calibrate import machine

REPO = Path(__file__).resolve().parents[1]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(command: list[str], cwd: Path) -> dict[str, float]:
    """Wall and CPU seconds of one command and its descendants; a failure stops the run."""
    wall0, cpu0 = time.monotonic(), _children_cpu_s()
    subprocess.run(command, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return {
        "wall_s": round(time.monotonic() - wall0, 1),
        "cpu_s": round(_children_cpu_s() - cpu0, 1),
    }


def one_round(commit: str, folder: Path) -> dict[str, object]:
    """A fresh clone of `commit`: its set-up, then its type check from an empty cache."""
    tree = folder / commit
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(tree)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=tree, check=True)
    setup = _timed(["bash", "scripts/setup.sh"], tree)
    mypy = _timed([str(tree / ".venv/bin/mypy")], tree)
    shutil.rmtree(tree)
    return {"commit": commit, "setup": setup, "mypy_cold": mypy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", nargs=2, required=True, metavar=("BASE", "NEW"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    commits = [
        subprocess.run(
            ["git", "rev-parse", "--short", c], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout.strip()
        for c in args.commits
    ]
    result: dict[str, object] = {
        "machine": machine()["cpu"],
        "cpus": os.cpu_count(),
        "pip_find_links": os.environ.get("PIP_FIND_LINKS", ""),
        "load_before": os.getloadavg()[0],
    }
    rounds: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="dsbd-setup-time-") as folder:
        for index in range(args.rounds):
            order = commits if index % 2 == 0 else commits[::-1]
            for commit in order:
                row = one_round(commit, Path(folder))
                row["round"] = index + 1
                rounds.append(row)
                print(json.dumps(row), flush=True)
    result["rounds"] = rounds
    result["load_after"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
