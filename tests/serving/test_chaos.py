"""The short chaos run (issues 21, 50): `dsbd bench chaos`, 8 clients, 3 replicas and Ray's GCS
SIGKILLed.

The benchmark starts its own `dsbd serve` (tiny float64 models, so the served seeded decodes equal
the in-process ones draw for draw), under `strace -f` when strace exists, runs the clients (the
request mix of `dsbd bench load`, clients that go away on purpose, seeded requests), kills a router,
a draft and a verifier replica and the GCS (its tables in a Redis the bench starts: `dsbd serve
--gcs-redis`) while they run (each 10-14 s after the previous recovery; load for at least 60 s and
until 12 s past the last recovery), and compares the seeded requests with the in-process engine
afterwards. The long run (32 clients x 10 min) is `dsbd bench chaos` with its defaults;
docs/RELIABILITY.md has its command and figures.

`dsbd bench soak`'s arithmetic (growth per process over the last window) is checked here on
made-up samples: its real run takes 30 minutes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsbd.bench import soak, soak_trends
from dsbd.cli import main as dsbd_main
from tests.support.loopback import is_loopback, peers
from tests.support.serving_harness import REPO, tiny_app
from tests.support.tiny_models import build_pair


def test_replicas_killed_under_load_lose_no_request(tmp_path: Path) -> None:
    target, draft = build_pair(tmp_path / "models")
    app = tiny_app(target, draft)
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [app]}))
    out, trace = tmp_path / "chaos.json", tmp_path / "trace"
    command = [
        sys.executable,
        "-m",
        "dsbd",
        "bench",
        "chaos",
        "--config",
        str(config),
        "--clients",
        "8",
        "--duration",
        "60",
        "--kills",
        "4",
        "--first-kill",
        "8",
        "--kill-every",
        "10",
        "14",
        "--quiet-tail",
        "12",
        "--targets",
        "router,draft,verifier,gcs",
        "--seed",
        "3",
        "--num-cpus",
        "8",
        "--strace",
        str(trace),
        "--workdir",
        str(tmp_path / "server"),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, timeout=420, cwd=REPO)
    results = json.loads(out.read_text())
    shown = {k: v for k, v in results.items() if k not in ("requests", "config")}
    print(json.dumps(shown, indent=1))
    sides = sorted(k["side"] for k in results["kill_log"])
    assert results["kills"] == 4, results["kill_log"]
    assert sides == ["draft", "gcs", "router", "verifier"], results["kill_log"]
    (gcs,) = [k for k in results["kill_log"] if k["side"] == "gcs"]
    assert gcs["outage_s"] is not None and gcs["outage_s"] <= gcs["recovered_s"], gcs
    assert results["failed"] == 0, (results["failed_by_status"], results["failed_causes"])
    assert results["status_5xx"] == 0
    # a draft or verifier kill costs the server a retried iteration, a router kill a hand-over
    # from the ingress: never a client's retry
    assert results["client_retries"] == 0, results["client_retry_causes"]
    assert results["status_5xx_answered"] == 0
    assert results["completed"] >= 40 and results["abandoned"] >= 4, results
    assert results["all_recovered"] and results["max_recovery_s"] <= 60, results["kill_log"]
    seeded = results["seeded"]
    assert seeded["compared"] >= 5 and seeded["equal"] == seeded["compared"], seeded
    assert seeded["max_log_likelihood_difference"] < 1e-9
    assert results["server_leftover_processes"] == []
    assert all(v == 0 for k, v in results["sessions_after"].items() if k != "drained_after_s")
    assert out.with_suffix(".png").stat().st_size > 10_000
    if shutil.which("strace"):
        outside = sorted(a for a in peers(trace) if not is_loopback(a))
        assert not outside, f"the server tried to reach: {outside}"


def test_soak_growth_is_measured_per_process_over_the_last_window() -> None:
    mib = 2**20
    samples = []
    for i in range(13):  # every 10 s for 2 minutes; the window: the last 60 s
        flat, leaking = 100 * mib, (100 + i) * mib  # +1 MiB a sample
        processes = {
            "dsbd:Verifier 11": {"rss": leaking, "pss": leaking},
            "dsbd:Draft 12": {"rss": flat, "pss": flat},
        }
        if i >= 10:
            processes["dsbd:Router 13"] = {"rss": flat, "pss": flat}  # started in the window
        samples.append((10.0 * i, processes))
    report = soak.memory_report(samples, window_s=60.0)
    assert report["window_s"] == 60.0 and report["samples"] == 7
    growth = report["rss_growth_after_warmup"]
    assert growth["dsbd:Draft 12"] == 0.0
    assert abs(growth["dsbd:Verifier 11"] - (111 / 107 - 1)) < 1e-4  # last 3 over first 3
    assert report["rss_details"]["dsbd:Verifier 11"]["slope_per_hour"] > 0
    # the fitted line rises 6 MiB across the 60 s window, over the same start; no residual
    assert abs(report["rss_trend_after_warmup"]["dsbd:Verifier 11"] - 6 / 107) < 1e-4
    assert report["rss_details"]["dsbd:Verifier 11"]["trend_se"] == 0.0
    assert report["started_in_window_mib"] == {"dsbd:Router 13": 100.0}


def test_soak_trend_tells_noise_at_the_window_ends_from_growth() -> None:
    """20 minutes of a flat process swinging +-3 % from sample to sample, caught low by the
    window's first three samples and high by its last three: +6.2 % by the end points, +1 % by
    the fitted trend, within its standard error of zero; a leak of the same size rises as much
    by both (dsbd/bench/soak.py's module docstring)."""
    times = [10.0 * i for i in range(120)]
    noisy = [100 + 3 * (-1) ** i for i in range(120)]
    noisy[:3], noisy[-3:] = [97] * 3, [103] * 3
    details = soak.growth(times, noisy, unit=1)
    assert abs(details["growth"] - (103 / 97 - 1)) < 1e-4
    assert details["trend"] < 0.011 and details["trend"] < 1.1 * details["trend_se"]
    leaking = soak.growth(times, [100 + 0.05 * i for i in range(120)], unit=1)
    assert abs(leaking["trend"] - leaking["growth"]) < 0.002 and leaking["trend_se"] < 1e-6


def test_soak_trends_reads_saved_soaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dsbd bench soak --trends` puts a saved soak's end-point growth and fitted trend side by
    side per process (the names without their pids), from the file a soak writes."""
    mib, samples = 2**20, []
    for i in range(13):
        leaking = (100 + i) * mib
        samples.append((10.0 * i, {"dsbd:Verifier 11": {"rss": leaking, "pss": leaking}}))
    saved = {
        **soak.memory_report(samples, window_s=60.0),
        "samples": [{"t": t, **{k: v["rss"] for k, v in s.items()}} for t, s in samples],
    }
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(saved))
    row = soak_trends.trends(path)["dsbd:Verifier"]
    assert abs(row["rss_end"] - (111 / 107 - 1)) < 1e-4 and abs(row["pss_trend"] - 6 / 107) < 1e-3
    assert row["rss_trend_se"] == 0.0
    assert dsbd_main(["bench", "soak", "--trends", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {str(path): {"dsbd:Verifier": row}}


def test_soak_reports_private_shared_and_replica_statistics_apart() -> None:
    mib = 2**20
    samples, replicas = [], []
    for i in range(13):
        shared = (4 + i) * mib  # object-store pages touched: RSS grows, the private heap not
        samples.append(
            (
                10.0 * i,
                {
                    "raylet 7": {
                        "rss": 40 * mib + shared,
                        "pss": 40 * mib,
                        "anon": 17 * mib,
                        "shmem": shared,
                    }
                },
            )
        )
        replicas.append(
            (
                10.0 * i,
                {
                    "draft 12": {
                        "allocated": (500 + i) * mib,
                        "python_blocks": 1000,
                        "cached_sessions": 3,
                    }
                },
            )
        )
    report = soak.memory_report(samples, window_s=60.0)
    assert report["anon_growth_after_warmup"]["raylet 7"] == 0.0
    assert report["shmem_growth_after_warmup"]["raylet 7"] > 0.3
    draft = soak.replica_report(replicas, window_s=60.0)["draft 12"]
    assert draft["python_blocks"]["growth"] == 0.0 and draft["python_blocks"]["last"] == 1000
    assert abs(draft["allocated"]["growth"] - (511 / 507 - 1)) < 1e-4
    assert draft["allocated"]["last_mib"] == 511.0
    empty = soak.replica_sample(None)
    assert empty == {}
