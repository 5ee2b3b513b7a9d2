"""How long a `dsbd serve` takes to be ready, code against code, interleaved.

    python benchmarks/server_start.py --trees /tmp/base /tmp/new --rounds 3 [--idle-s 60] [--shared]
    python benchmarks/server_start.py --trees . --readme

Each tree is a checkout (a `git worktree` of the commit to measure, with `.venv` linked to this
one's). Per round and tree, in a process whose PYTHONPATH is that tree: a one-application server
of the tiny float64 pair (tests/support/serving_harness.tiny_app) started until ready, one decode,
stopped; the wall seconds to ready and the machine's busy CPU seconds over the start (/proc/stat),
the wall seconds of the stop (SIGINT until no process of the server is left),
and `import deployments.app`'s CPU seconds. `--idle-s S`: after the decode, the CPU its
processes (the server's session) use in S seconds with no request, per minute and process
kind (`ray::ServeReplica:...`, `ray::IDLE`, `raylet`, ...), and how many of each run; and the
20 busiest threads (main threads by process kind, the others by name, summed over processes):
CPU seconds a minute and context switches (wake-ups) a second.
`--shared`: the test suite's shared server (serving_harness.write_config) instead.
`--envs 'A=1 B=2' ''`: each tree under each of these settings (added to the environment), the
runs of a round in turn and every other round reversed.
`--readme`: `dsbd serve` with no options (the README's command) and
test_the_readme_main_command's request twice, on a fresh calibration folder (the first
adaptive request waits for the pair's served calibration). Prints JSON lines;
results in benchmarks/results/suite_time_epyc.json ("deployments_by_path",
"readme_command_first_request")."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv/bin/python"
ONE_START = """
import collections, json, os, sys, time, tempfile, requests, yaml
from pathlib import Path
from tests.support.serving_harness import tiny_app, write_config
from tests.support.tiny_models import build_pair, build_wide
from dsbd import server_process
IDLE_S, SHARED = float(sys.argv[1]), sys.argv[2] == "shared"
def busy():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / 100
def processes(session):  # (pid, kind, its /proc stat fields) of the server's processes
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            title = open(f"/proc/{pid}/cmdline").read().split("\\0")[0]
        except OSError:
            continue
        if int(stat[3]) == session:
            # a Ray worker's title names its task too (ray::ServeController.listen_for_change)
            yield pid, title.split(".")[0] if title.startswith("ray::") else Path(title).name, stat
def by_kind(session):  # CPU seconds and count of the server's processes, by process title
    cpu, count = collections.Counter(), collections.Counter()
    for _, kind, stat in processes(session):
        cpu[kind] += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        count[kind] += 1
    return cpu, count
def by_thread(session):  # CPU seconds and context switches of its threads: main ones by kind
    cpu, switches = collections.Counter(), collections.Counter()
    for pid, kind, _ in processes(session):
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
            try:
                name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                stat = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                status = open(f"/proc/{pid}/task/{tid}/status").read().splitlines()
            except OSError:
                continue
            key = f"{kind} (main thread)" if tid == pid else name
            cpu[key] += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
            switches[key] += sum(int(x.split()[1]) for x in status if "ctxt_switches" in x)
    return cpu, switches
root = Path(tempfile.mkdtemp())
target, draft = build_pair(root / "models")
config = root / "serve.yaml"
config.write_text(yaml.safe_dump({"applications": [tiny_app(target, draft)]}))
if SHARED:  # the test suite's shared server: six applications, 33 replicas, 2 TP ranks
    (root / "shared").mkdir()
    config = write_config(root / "shared", target, draft, build_wide(root / "wide"))
t0, c0 = time.time(), busy()
server = server_process.start(root / "server", config, num_cpus=8)
ready, cpu = time.time() - t0, busy() - c0
body = {"prompt_ids": [5, 17, 42], "max_new_tokens": 8, "seed": 1, "adaptive": False}
t1 = time.time()
beams = requests.post(f"{server.base_url}/v1/dsbd/generate", json=body, timeout=300).json()["beams"]
decode = time.time() - t1
record = {"ready_s": round(ready, 1), "machine_cpu_s": round(cpu, 1),
          "first_decode_s": round(decode, 2), "beams": len(beams)}
if IDLE_S:  # the server's processes' CPU over IDLE_S seconds with no request, by kind
    session = os.getsid(server.process.pid)
    start, count = by_kind(session)
    threads_start = by_thread(session)
    time.sleep(IDLE_S)
    end, _ = by_kind(session)
    threads_end = by_thread(session)
    record["processes"] = dict(count)
    record["idle_cpu_s_per_min"] = {
        kind: round((end[kind] - start[kind]) * 60 / IDLE_S, 2) for kind in sorted(end)
    }
    cpu = {k: (v - threads_start[0][k]) * 60 / IDLE_S for k, v in threads_end[0].items()}
    record["idle_threads"] = {  # the 20 busiest: CPU-s a minute, context switches a second
        k: [round(c, 2), round((threads_end[1][k] - threads_start[1][k]) / IDLE_S, 1)]
        for k, c in sorted(cpu.items(), key=lambda kc: -kc[1])[:20]
    }
t2 = time.time()
record["left"] = server_process.stop(server)
record["stop_s"] = round(time.time() - t2, 1)
print(json.dumps(record))
"""
README = """
import json, signal, time
from pathlib import Path
import openai
from dsbd import server_process
root = Path(__import__("tempfile").mkdtemp())
t0 = time.time()
server = server_process.start(root, timeout_s=900, exit_on_sigterm=False)
out = {"ready_s": round(time.time() - t0, 1)}
client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
for name in ("first_request_s", "second_request_s"):
    t = time.time()
    client.chat.completions.create(model="smollm2", max_tokens=12, n=2, seed=0,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        extra_body={"width": 3, "gamma": 2})
    out[name] = round(time.time() - t, 1)
t = time.time()
server_process.stop(server, signal.SIGTERM)
out["stop_s"] = round(time.time() - t, 1)
print(json.dumps(out))
"""


def _run(tree: Path, code: str, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(VENV_PYTHON), "-c", code, *args],
        cwd=tree,
        env={**env, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return done.stdout.strip().splitlines()[-1]


def _import_cpu_s(tree: Path, env: dict[str, str]) -> float:
    code = "import resource, deployments.app; u = resource.getrusage(resource.RUSAGE_SELF); "
    code += "print(u.ru_utime + u.ru_stime)"
    return round(float(_run(tree, code, env)), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--readme", action="store_true", help="the README's command instead")
    parser.add_argument(
        "--idle-s", type=float, default=0, help="then this long idle: its CPU by process kind"
    )
    parser.add_argument(
        "--shared", action="store_true", help="the test suite's shared server instead"
    )
    parser.add_argument(
        "--envs",
        nargs="+",
        default=[""],
        help="settings to compare on each tree, each 'NAME=VALUE ...' ('' for none), interleaved",
    )
    args = parser.parse_args()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    base["TOKENIZERS_PARALLELISM"] = "false"
    print(json.dumps({"load_before": os.getloadavg()[0]}), flush=True)
    runs = [(tree, settings) for tree in args.trees for settings in args.envs]
    for round_ in range(args.rounds):
        for tree, settings in runs if round_ % 2 == 0 else runs[::-1]:
            record = {"round": round_ + 1, "tree": str(tree), "envs": settings}
            env = {**base, **dict(item.split("=", 1) for item in settings.split())}
            if args.readme:
                env["DSBD_CALIBRATION_DIR"] = tempfile.mkdtemp()
                record.update(json.loads(_run(tree, README, env)))
            else:
                record.update(
                    json.loads(
                        _run(
                            tree,
                            ONE_START,
                            env,
                            str(args.idle_s),
                            "shared" if args.shared else "one",
                        )
                    )
                )
                record["import_app_cpu_s"] = _import_cpu_s(tree, env)
            print(json.dumps(record), flush=True)
    print(json.dumps({"load_after": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
