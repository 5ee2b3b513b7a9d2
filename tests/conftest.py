"""One torch thread per test process: on 2 shared cores more threads are 5-25x slower whenever
anything else runs (ENVIRONMENT.md), and timings stay comparable.

`served` is the four-application server (tests/serving_harness.py) that tests/test_serving.py
and tests/test_serving_api.py share: starting its 22 replicas takes minutes of CPU on two
cores, so it starts once, and stops right after the last test that uses it rather than at the
end of the session (its replicas hold gigabytes the later tests should have)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

torch.set_num_threads(1)

_OPEN: dict[str, contextlib.ExitStack] = {}


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The shared server's url, model dirs, strace dir, log and pid (serving_harness)."""
    from .serving_harness import running_server  # only where a test asks for the server

    with contextlib.ExitStack() as stack:
        _OPEN["served"] = stack
        yield stack.enter_context(running_server(tmp_path_factory.mktemp("serving")))


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
