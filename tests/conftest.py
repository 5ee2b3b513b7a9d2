"""One torch thread per test process: on 2 shared cores more threads are 5-25x slower whenever
anything else runs (docs/ARCHITECTURE.md, "Measured facts about CPUs"), and timings stay
comparable.

Order (docs/ARCHITECTURE.md, "Tests"): the tests that start Ray or a `dsbd serve` (marked `ray`)
are one scheduling unit, handed out first, in file order, and last among them those of `served`,
the six-application server (tests/support/serving_harness.py) that tests/serving/test_faults.py,
test_lm_eval.py, test_serving.py, test_serving_api.py and others share: starting its 30 replicas
takes minutes of CPU on two cores, so it starts once, its tests run back to back, and it stops
right after the last of them (its replicas hold gigabytes). The suite runs on two pytest-xdist
workers (`-n 2 --dist loadgroup`, pyproject.toml): one runs the `ray` unit, so no two modules'
clusters run at once; the other runs the in-process tests (one core each) meanwhile, filling the
core that the servers' replicas leave idle while they wait on each other, and both run what is left
of them once the `ray` unit is done. The in-process test that loads the Qwen pair (~9 GB) goes
first, beside one-application servers, long before the shared server's ~13-16 GB is up (within
tests/serving/test_serve_run.py the README command's server runs beside the other test's, its
first request waiting on one core for the embedded pair's calibration)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

torch.set_num_threads(1)

_OPEN: dict[str, contextlib.ExitStack] = {}
_CALIBRATION = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The shared server's url, model dirs, strace dir, log and pid (serving_harness)."""
    from .support.serving_harness import running_server  # only where a test asks for the server

    with contextlib.ExitStack() as stack:
        _OPEN["served"] = stack
        yield stack.enter_context(running_server(tmp_path_factory.mktemp("serving")))


# The modules whose tests start Ray or a `dsbd serve`: each takes both cores while its replicas
# start, and two clusters at once would hold two servers' memory. A module starts Ray in all of
# its tests or in none (xdist's controller schedules by test id: it collects nothing).
RAY_MODULES = frozenset(
    f"tests/{name}.py"
    for name in (
        "batch/test_batch",
        "batch/test_batch_streaming",
        "serving/test_chaos",
        "serving/test_faults",
        "serving/test_gcs_ft",
        "serving/test_lm_eval",
        "serving/test_local_ray",
        "serving/test_observability",
        "serving/test_serve_run",
        "serving/test_serving",
        "serving/test_serving_api",
        "serving/test_serving_penalties",
        "serving/test_serving_guarded",
        "serving/test_tp_group",
    )
)


# The in-process module that loads the installed Qwen pair in float32 (~9 GB; skipped where
# `dsbd models install qwen-coder` has not run): its tests go first, beside the one-application
# servers of the `ray` unit's first modules, never beside the shared server's ~13-16 GB.
MEMORY_FIRST = frozenset({"tests/models/test_real_drafts.py"})


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# Python's cyclic collector in the test processes: young collections every 10,000 allocations
# (not 700), and the objects alive once the tests are collected (torch's, transformers', the
# test modules') frozen out of every collection. The exactness tests make millions of objects
# per decode of 1e5 sessions; with the defaults, collections over the whole heap took a fifth
# of their CPU (test_exactness's fixed-width tests at width 3, one process: 52.7 CPU-s against
# 42.3, means of 3 interleaved rounds on the 2-core AMD EPYC; benchmarks/results/
# suite_time_epyc.json, "gc_in_tests"). Cycles are still collected, so memory stays bounded.
GC_THRESHOLDS = (10_000, 10, 10)


def pytest_configure(config: pytest.Config) -> None:
    """The calibrations the tests make go to one temporary folder per run, not the user's cache:
    their pairs live in temporary folders, so every run would add new files under
    ~/.cache/dsbd (servers and Ray replicas inherit the variable; xdist's workers start after
    this and inherit it too; the folder is removed at the end). And the collector's thresholds
    (`GC_THRESHOLDS`)."""
    gc.set_threshold(*GC_THRESHOLDS)
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tempfile.mkdtemp(prefix="dsbd-test-calibration-")
        config.stash[_CALIBRATION] = folder
        os.environ["DSBD_CALIBRATION_DIR"] = folder


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CALIBRATION, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`-s` (print what the tests print) runs in this process: xdist's workers' output never
    reaches the terminal. An explicit `-n` still wins."""
    args = config.invocation_params.args
    explicit = any(a.startswith(("-n", "--numprocesses")) for a in args)
    if config.getoption("capture", "fd") == "no" and not explicit:
        config.option.numprocesses = 0


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    ray = [item for item in items if _module(item.nodeid) in RAY_MODULES]
    for item in ray:
        item.add_marker(pytest.mark.ray)
    served = [item for item in ray if "served" in getattr(item, "fixturenames", ())]
    rest = [item for item in ray if item not in served]
    # the `ray` unit first (one worker runs it from the start); then the in-process tests:
    # `MEMORY_FIRST`, the modules with slow tests (so that the workers end together), the rest
    # (each module's tests stay together: its module-scoped fixtures are built once)
    inprocess = [item for item in items if item not in ray]
    slow = {_module(item.nodeid) for item in inprocess if item.get_closest_marker("slow")}
    inprocess.sort(  # stable
        key=lambda item: (
            _module(item.nodeid) not in MEMORY_FIRST,
            _module(item.nodeid) not in slow,
        )
    )
    items[:] = rest + served + inprocess


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadgroup`: every `ray` test in one unit, handed out first, and each
    in-process test a unit of its own, handed out in collection order to whichever worker asks
    (xdist's own `xdist_group` marks rename test ids, which pytest 9.2's ids no longer allow)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the collection order: `ray` first

    class RayFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if _module(nodeid) in RAY_MODULES else nodeid

    return RayFirst(config, log)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared server once no test left to run uses it (closing twice is a no-op)."""
    stack = _OPEN.get("served")
    if stack is None or "served" not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    later = items[items.index(item) + 1 :]
    if not any("served" in getattr(other, "fixturenames", ()) for other in later):
        _OPEN.pop("served").close()
