"""Where the test suite's CPU goes, test by test: a pytest plugin.

    PYTHONPATH=benchmarks SUITE_CPU_OUT=/tmp/cpu .venv/bin/pytest -p suite_cpu -m "not ray"
    PYTHONPATH=benchmarks SUITE_CPU_OUT=/tmp/cpu .venv/bin/pytest -p suite_cpu -m ray

Per test (setup, call and teardown, so a module fixture's start lands in the test that ran it):
the wall seconds, the CPU seconds of the test's own process (`time.process_time`) and of the
children it reaped (`RUSAGE_CHILDREN`), and the machine's busy CPU seconds (/proc/stat), which
count a test's servers too but also anything else running: time the Ray unit alone (`-m ray`;
one xdist worker runs it) on an otherwise idle machine. Each worker writes
`SUITE_CPU_OUT.<worker>.json`. The suite is CPU-bound on two cores, so CPU, not wall time, says
what a test costs it. Start pytest from a shell that does not ignore SIGINT (a background job of
a non-interactive shell does, and test_batch_streaming checks that `dsbd batch` sees it
restored). Figures: benchmarks/results/suite_time_epyc.json, "cpu_by_test_ae14ee8"."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest

_ROWS: list[dict[str, Any]] = []


def _machine_busy_s() -> float:
    """CPU seconds the machine has spent busy (user, nice, system, irq, softirq)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    wall, own, children, machine = (
        time.time(),
        time.process_time(),
        _children_s(),
        _machine_busy_s(),
    )
    yield
    _ROWS.append(
        {
            "id": item.nodeid,
            "wall": round(time.time() - wall, 2),
            "self": round(time.process_time() - own, 2),
            "children": round(_children_s() - children, 2),
            "machine": round(_machine_busy_s() - machine, 2),
        }
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("SUITE_CPU_OUT")
    if out and _ROWS:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{out}.{worker}.json", "w") as file:
            json.dump(_ROWS, file)
