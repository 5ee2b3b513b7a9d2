"""Ctrl-C stops `dsbd batch` with status 130 wherever it lands, however the process started.

A shell without job control starts a background command (`dsbd batch ... &` in a script) with
SIGINT ignored, and Python then installs no handler: SIGINT would be dropped by the kernel and
the job would decode everything and exit 0. `interruptible` makes SIGINT raise
KeyboardInterrupt for the command's duration. Without Ray here: the handler, and Ctrl-C during
the checks and during planning; with Ray (the real job interrupted mid-pipeline, started with
SIGINT ignored, then resumed): tests/batch/test_batch_streaming.py.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deployments.batch_job.job
from deployments.batch_job.job import interruptible
from dsbd.cli import main
from tests.support.tiny_models import build_pair


@pytest.fixture
def sigint() -> Iterator[None]:
    """The test process's SIGINT disposition, put back after the test changed it."""
    found = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)


def test_sigint_raises_inside_even_when_the_process_ignores_it(sigint: None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` from a script starts it
    with pytest.raises(KeyboardInterrupt):
        with interruptible():
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back

    # SIG_DFL would kill the driver before it stops Ray: replaced too (not raised here, lest
    # a failure kill the test run).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with interruptible():
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL


def test_a_callers_handler_and_other_threads_are_left_alone(sigint: None) -> None:
    calls: list[int] = []

    def mine(signum: int, _: Any) -> None:
        calls.append(signum)

    signal.signal(signal.SIGINT, mine)
    with interruptible():
        signal.raise_signal(signal.SIGINT)
    assert calls == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is mine

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen: list[Any] = []

    def elsewhere() -> None:  # Python sets no handler outside the main thread: no error
        with interruptible():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [signal.SIG_IGN]


def test_ctrl_c_during_the_checks_or_planning_exits_130(
    tmp_path: Path, monkeypatch, capsys, sigint: None
) -> None:
    def no_ray(*_: Any) -> None:
        raise AssertionError("Ray was started after Ctrl-C")

    def ctrl_c(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(deployments.batch_job.job, "_start_ray", no_ray)
    target, draft = build_pair(tmp_path / "models")
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    argv = ["batch", "--target", str(target), "--draft", str(draft)]
    argv += ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    with monkeypatch.context() as patched:
        patched.setattr(deployments.batch_job.job, "check_models", ctrl_c)  # the checks
        assert main(argv) == 130
    assert "dsbd batch: interrupted before the job started" in capsys.readouterr().err

    with monkeypatch.context() as patched:
        patched.setattr(deployments.batch_job.job, "plan_input", ctrl_c)
        assert main(argv) == 130
    err = capsys.readouterr().err
    assert "dsbd batch: interrupted; rerun the same command to resume" in err, err
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back
