"""Fault injection for the reliability tests: a replica process that dies inside a chosen call.

Why: a SIGKILL from outside may land between two calls of a replica, and Ray Serve reroutes
the calls a dead replica never accepted, so a kill test cannot be sure the retry path runs
(docs/RELIABILITY.md, section 3). A replica that exits *inside* a call it has accepted makes
that path certain.

Off unless the environment variable `DSBD_FAULT_INJECT` is set in the replica's process (in the
environment of `dsbd serve`, or per application with `runtime_env: {env_vars: {...}}` in a
Serve config, which the tensor-parallel rank actors inherit). Its value is a comma-separated
list of `ROLE:CALL:N`: the process playing ROLE exits with `os._exit` (no clean-up, as after a
SIGKILL) inside its N-th CALL, after accepting it:

    draft:propose:N      a Draft replica, in the batch that holds its N-th propose call
    verifier:verify:N    a Verifier replica, in the batch that holds its N-th verify call
    router:decode:N      a Router replica, at the start of its N-th decode (stream: its N-th
                         streamed decode), with its other decodes in flight
    tp-rankK:METHOD:N    tensor-parallel rank K, in its N-th call of METHOD (forward, set_roots)

Every process counts its own calls, so a replacement replica would die again at its N-th
call; with `DSBD_FAULT_INJECT_DIR` set, each fault fires once per folder (the first process to
create its claim file there dies, the others live): give each run a fresh folder.

`DSBD_FAULT_INJECT=@PATH` reads the list from the file PATH at every counted call instead, so a
test arms and disarms faults in a running application (one application for several faults):
whenever the list a process reads differs from the last one it saw, its counts start again, so
N counts the calls after arming.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ENV = "DSBD_FAULT_INJECT"
DIR_ENV = "DSBD_FAULT_INJECT_DIR"
EXIT_CODE = 86  # what the process exits with (shows in Ray's logs as the worker's exit code)
# The calls each replica answers (the first: what `fault_point` counts when none is named).
REPLICA_CALLS = {"draft": ("propose",), "verifier": ("verify",), "router": ("decode", "stream")}
_ROLE = re.compile(r"^(draft|verifier|router|tp-rank\d+)$")
_counts: dict[tuple[str, str], int] = {}  # (role, call) -> calls counted in this process
_armed = [""]  # the list of faults this process counted its calls under


def parse(spec: str) -> list[tuple[str, str, int]]:
    """The faults of a `DSBD_FAULT_INJECT` value; ValueError naming the bad entry otherwise."""
    faults = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        parts = entry.split(":")
        ok = len(parts) == 3 and _ROLE.match(parts[0]) and parts[2].isdigit() and int(parts[2])
        if ok and parts[0] in REPLICA_CALLS and parts[1] not in REPLICA_CALLS[parts[0]]:
            ok = False
        if not ok:
            raise ValueError(
                f"{ENV}={spec!r}: entry {entry!r} is not ROLE:CALL:N; allowed: draft:propose:N, "
                "verifier:verify:N, router:decode:N, router:stream:N, tp-rankK:METHOD:N with "
                "N >= 1"
            )
        faults.append((parts[0], parts[1], int(parts[2])))
    return faults


def fault_point(role: str, call: str | None = None, calls: int = 1) -> None:
    """Count `calls` more calls of `call` in this process; exit inside the one a fault names.

    Costs one dictionary lookup when `DSBD_FAULT_INJECT` is unset (the default)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    if spec.startswith("@"):  # armed from a file (module docstring)
        try:
            spec = Path(spec[1:]).read_text().strip()
        except OSError:
            spec = ""
    if spec != _armed[0]:
        _armed[0] = spec
        _counts.clear()
    if not spec:
        return
    call = call or REPLICA_CALLS[role][0]
    before = _counts.get((role, call), 0)
    _counts[(role, call)] = after = before + calls
    for fault_role, fault_call, n in parse(spec):
        hit = (fault_role, fault_call) == (role, call) and before < n <= after
        if hit and _claim(role, call, n):
            print(
                f"dsbd: {ENV}: {role} exits inside its {call} call {n} (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_CODE)


def _claim(role: str, call: str, n: int) -> bool:
    """Whether this process is the one to die: always without `DSBD_FAULT_INJECT_DIR`, else
    only the first process to create the fault's claim file there."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return True
    try:
        descriptor = os.open(Path(folder) / f"{role}-{call}-{n}", os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    os.close(descriptor)
    return True
