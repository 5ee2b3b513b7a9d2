"""Certain failure paths and memory admission, end to end on `dsbd serve` (issue 21).

On the shared server (tests/support/serving_harness.py: tiny float64 models, so a served decode
equals the in-process one draw for draw, under `strace -f` when strace exists; its loopback check
is tests/serving/test_serving.py's last test). Its applications:

* `/` and `/tp`: a draft replica, a verifier replica, the router, or rank 1 of the tensor-parallel
  verifier (2 ranks) that exits inside a chosen call (deployments/faults.py), each test arming its
  fault in the running application through a file (`DSBD_FAULT_INJECT=@file`), once per run
  through a claim folder. A SIGKILL from outside may land between calls and lose none; this
  cannot.
* `/fpair`: the co-located layout (deployments/decode/pair.py), its verifier exiting inside a
  call: the pair replica's decode loops die with it and the ingress hands them over.
* `/memory`: a pair with large KV caches per token (16 layers) and a small session-memory
  budget, so long prompts exhaust it (deployments/api/admission.py).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import torch
from transformers import LlamaConfig

from deployments import faults
from deployments.decode.session import RETRY_WINDOW_S
from deployments.replicas.memory import WORKING_COPIES, kv_bytes_per_token
from tests.support.serving_harness import (
    MEMORY_BUDGET,
    assert_same,
    in_process_decoder,
    native,
    status,
)
from tests.support.tiny_models import WIDE

FAULTS = {
    "fdraft": "draft:propose:15",
    "fverifier": "verifier:verify:15",
    "ftp": "tp-rank1:forward:6",
    "frouter": "router:decode:5",
    "fpair": "verifier:verify:15",  # inside a co-located pair: the loops die with the models
}
# The application each fault is armed in (its route prefix: `PREFIX`).
APPS = {
    "fdraft": "dsbd",
    "fverifier": "dsbd",
    "frouter": "dsbd",
    "ftp": "tp",
    "fpair": "fpair",
}
PREFIX = {"dsbd": "", "tp": "/tp", "fpair": "/fpair"}
# A decode of PROMPT tokens (+ 8 new + gamma 2 x W_S 2 columns, width 2) is charged
# 2 x 612 x 32 KiB x WORKING_COPIES = 153 MiB on each side: two fit in BUDGET, a third does
# not; a prompt of NEVER tokens (503 MiB) never fits.
BUDGET = MEMORY_BUDGET  # session_memory_bytes of the /memory replicas
PROMPT = 600  # tokens of the long prompts
NEVER = 2000  # tokens of the prompt that can never fit


@pytest.fixture(scope="module")
def server(served):
    return served


@pytest.fixture(scope="module")
def reference(server):
    return in_process_decoder(server)


@pytest.mark.parametrize("app", list(FAULTS))
def test_a_replica_that_dies_inside_a_call_costs_a_retry_not_the_request(server, reference, app):
    """8 decodes in flight; the draft, the verifier or TP rank 1 exits inside its N-th call, or
    the router (which runs all 8 decode loops) at the start of its N-th decode: every decode
    completes, equal draw for draw to the in-process decode (what the no-fault run returns),
    and the lost iterations show in `serving.retries`, the decodes the ingress handed to a new
    router in `serving.handovers`."""
    name = APPS[app]
    prefix = PREFIX[name]
    armed = server["root"] / f"armed-{name}"
    claims_before = set(os.listdir(server["root"] / f"claims-{name}"))
    before = status(server, prefix)
    bodies = [
        {
            "prompt_ids": [40 + i, 31, 32],
            "seed": 300 + i,
            "max_new_tokens": 24,
            "width": 2 + i % 2,
            "gamma": 2,
            "adaptive": False,
        }
        for i in range(8)
    ]
    # a decode may wait up to the router's retry window for the replacement replica, then
    # decodes: the client waits that long and the decode's own time beside it
    wait_s = RETRY_WINDOW_S + 120
    armed.write_text(FAULTS[app])  # this test's fault, armed while it runs
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            results = list(pool.map(lambda body: native(server, body, prefix, wait_s), bodies))
    finally:
        armed.write_text("")
    for body, got in zip(bodies, results, strict=True):
        knobs = {k: v for k, v in body.items() if k not in ("prompt_ids", "adaptive")}
        assert_same(got, reference("dsbd", body["prompt_ids"], **knobs))
    handed = app in ("frouter", "fpair")  # the loop died: the ingress hands the decode over
    what = "handovers" if handed else "retries"
    retries = [r for got in results for r in got["stats"]["serving"][what]]
    print(f"{FAULTS[app]}: {len(retries)} {what}: {sorted({r.split(': ')[1] for r in retries})}")
    assert retries, f"no {what}: the injected fault did not cost a call"
    lost = ("TensorParallelBroken", "ActorDied") if app == "ftp" else ("ActorDied",)
    assert all(any(word in r for word in lost) for r in retries), retries
    claims = set(os.listdir(server["root"] / f"claims-{name}")) - claims_before
    assert claims == {"-".join(FAULTS[app].split(":"))}, claims  # the fault fired, once
    after = status(server, prefix)
    side = {"fdraft": "draft", "frouter": "router", "fpair": "router"}.get(app, "verifier")
    assert after[side]["replica"] != before[side]["replica"], "the replica was not replaced"
    # seeded decodes: the caches lost with the replica were rebuilt by replaying the sessions'
    # iterations (dsbd_core/algorithm/drivers/replay.py), never re-prefilled
    replays = [r for got in results for r in got["stats"]["serving"]["replays"]]
    print(f"{len(replays)} replays: {replays[:4]}")
    if handed:  # the new router (pair) starts the decodes over: nothing to rebuild
        assert not replays, replays
    else:
        replayed = "draft replayed" if app == "fdraft" else "verifier replayed"
        assert any(replayed in r for r in replays), replays


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _peak(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _long(i: int, tokens: int = PROMPT, **knobs: Any) -> dict[str, Any]:
    return {
        "prompt_ids": [5 + (i * 31 + k * 7) % 300 for k in range(tokens)],
        "seed": i,
        "max_new_tokens": 8,
        "width": 2,
        "gamma": 2,
        "adaptive": False,
        **knobs,
    }


def _until_admitted(server, body: dict[str, Any], refused: list[int]) -> dict[str, Any]:
    """Send until admitted: a 429 (memory taken) is retried shortly, as a client would."""
    while True:
        response = requests.post(f"{server['url']}/memory/v1/dsbd/generate", json=body, timeout=300)
        if response.status_code != 429:
            assert response.status_code == 200, response.text
            return response.json()
        assert "session_memory_bytes" in response.json()["error"]["message"]
        refused.append(429)
        time.sleep(0.2)


def test_sessions_are_admitted_by_kv_bytes_and_peak_memory_stays_in_budget(server) -> None:
    """Long prompts against a small budget: a decode that can never fit is 400 naming the field
    and the limit; beyond the budget 429 (retried here until admitted), never a crash; the
    replicas' peak memory above their idle level stays under the budget."""
    wide = LlamaConfig(**WIDE)
    charge = 2 * (PROMPT + 8 + 2 * 2) * kv_bytes_per_token(wide, torch.float64) * WORKING_COPIES
    assert 2 * charge <= BUDGET < 3 * charge  # two decodes at a time, not three
    never = requests.post(
        f"{server['url']}/memory/v1/dsbd/generate", json=_long(0, NEVER), timeout=60
    )
    assert never.status_code == 400, never.text
    error = never.json()["error"]
    assert error["param"] == "max_new_tokens"
    assert f"prompt of {NEVER} tokens" in error["message"]
    assert f"target.session_memory_bytes={BUDGET}" in error["message"], error["message"]
    _until_admitted(server, _long(99, 8), [])  # warm: first forwards, thread pools
    now = status(server, "/memory")
    pids = {side: now[side]["pid"] for side in ("verifier", "draft")}
    base = {side: _rss(pid) for side, pid in pids.items()}
    for pid in pids.values():
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    refused: list[int] = []
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: _until_admitted(server, _long(i), refused), range(6)))
    peaks = {side: _peak(pid) - base[side] for side, pid in pids.items()}
    after = status(server, "/memory")
    most = after["ingress"]["admitted_memory_peak_bytes"]["target"]  # high-water mark
    print(
        f"budget {BUDGET / 2**20:.0f} MiB, charge {charge / 2**20:.0f} MiB per decode: "
        f"{len(refused)} x 429, most admitted {most / 2**20:.0f} MiB; peak above "
        f"idle { ({k: round(v / 2**20) for k, v in peaks.items()}) } MiB"
    )
    assert len(results) == 6 and all(r["beams"] for r in results)
    assert refused, "no decode was refused: the budget was never reached"
    assert 2 * charge - 1 <= most <= BUDGET
    assert {side: after[side]["pid"] for side in pids} == pids, "a replica crashed"
    assert after["ingress"]["admitted_memory_bytes"] == {"target": 0, "draft": 0}
    for side, peak in peaks.items():
        assert peak <= BUDGET, f"{side} grew {peak / 2**20:.0f} MiB over its idle level"


def test_an_injected_fault_is_off_unless_asked(monkeypatch, tmp_path: Path) -> None:
    """deployments/faults.py: nothing happens without DSBD_FAULT_INJECT; a bad value names the
    entry; with a claim folder only the first process to reach the call dies."""
    exits: list[int] = []
    monkeypatch.setattr(faults.os, "_exit", exits.append)
    monkeypatch.delenv(faults.ENV, raising=False)
    for _ in range(5):
        faults.fault_point("draft", calls=3)
    assert exits == []
    with pytest.raises(ValueError, match=r"entry 'draft:verify:3' is not ROLE:CALL:N"):
        faults.parse("draft:verify:3")
    with pytest.raises(ValueError, match=r"entry 'verifier:verify:0'"):
        faults.parse("verifier:verify:0")
    assert faults.parse("draft:propose:3, tp-rank1:forward:4") == [
        ("draft", "propose", 3),
        ("tp-rank1", "forward", 4),
    ]
    monkeypatch.setenv(faults.ENV, "draft:propose:3,tp-rank1:forward:2")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(faults, "_counts", {})
    faults.fault_point("draft", calls=2)  # calls 1, 2
    faults.fault_point("verifier", calls=5)  # another role
    assert exits == []
    faults.fault_point("draft", calls=2)  # calls 3, 4: the batch holding call 3
    assert exits == [faults.EXIT_CODE]
    faults.fault_point("tp-rank1", "forward")
    faults.fault_point("tp-rank1", "set_roots")
    faults.fault_point("tp-rank1", "forward")
    assert exits == [faults.EXIT_CODE] * 2
    monkeypatch.setattr(faults, "_counts", {})  # a replacement process: the claim is taken
    faults.fault_point("draft", calls=4)
    assert exits == [faults.EXIT_CODE] * 2
