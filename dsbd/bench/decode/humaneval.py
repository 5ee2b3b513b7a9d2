"""HumanEval pass@1: a model's completion runs against the problem's tests, sandboxed.

Generated code is untrusted. It runs only in a child process:

* with a wall-clock timeout (the whole process group is killed), CPU, memory and file-size
  limits, an empty environment, a private temporary directory as cwd, `python -I -S`;
* without network. Preferred: a new network namespace (`unshare -n`: no interface but a down
  loopback, so every connect fails), and when this process is root the code also drops to
  user `nobody` (`setpriv`) so it cannot write the checkout. Where namespaces are unavailable
  the fallback is a Python audit hook installed before the code runs that refuses socket,
  subprocess, exec, fork and ctypes events. The hook is weaker (a C extension could bypass it)
  and is also installed on top of the namespace by default (`namespace+audit`).

The completion is the model's raw continuation of the problem prompt, cut at the first of the
standard HumanEval stop sequences (`STOP_SEQUENCES`, as in the Codex paper plus code fences), so
text the model writes after the function (tests, prints, prose) is not executed.
pass@1 with one answer per problem per method is the fraction of problems whose answer passes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```", "\nassert")
SandboxMode = Literal["namespace+audit", "namespace", "audit"]
NOBODY = 65534
DEFAULT_TIMEOUT_S = 10.0

# Runs first in the child: CPU seconds, address space and file size limits (set here, not in a
# preexec_fn, which is unsafe in a process with threads); with the audit variant, refuse the
# events through which code reaches the network or other programs (an audit hook cannot be
# removed once added); then run the program file as __main__.
_LIMITS = """
import resource, sys
_cpu = int(float(sys.argv[2])) + 1
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 20, 10 << 20))
"""
_AUDIT_PRELUDE = (
    _LIMITS
    + """
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "os.fork", "os.forkpty", "pty.", "ctypes.", "_posixsubprocess")
def _refuse(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_refuse)
import runpy
runpy.run_path(sys.argv[1], run_name="__main__")
"""
)
_PLAIN_PRELUDE = _LIMITS + "import runpy\nrunpy.run_path(sys.argv[1], run_name='__main__')\n"


@dataclass
class ExecutionResult:
    """Outcome of one completion: passed, failed (an exception / non-zero exit) or timeout."""

    status: Literal["passed", "failed", "timeout"]
    detail: str  # the end of stderr, or why it timed out

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def truncate_completion(text: str) -> str:
    """The completion up to the first stop sequence (the function body the model wrote)."""
    cut = len(text)
    for stop in STOP_SEQUENCES:
        index = text.find(stop)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]


@cache
def namespaces_available() -> bool:
    """True when `unshare -n` (as root) or `unshare -rn` (user namespace) works here."""
    if shutil.which("unshare") is None:
        return False
    command = ["unshare", "-n", "true"] if os.geteuid() == 0 else ["unshare", "-rn", "true"]
    try:
        return subprocess.run(command, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def default_sandbox() -> SandboxMode:
    """`namespace+audit` where network namespaces work, else `audit`."""
    return "namespace+audit" if namespaces_available() else "audit"


def program_text(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The file HumanEval runs: prompt + completion, the tests, and the call of `check`."""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"


def run_program(
    source: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, sandbox: SandboxMode | None = None
) -> ExecutionResult:
    """Run `source` in a sandboxed child process (see the module docstring)."""
    mode = sandbox or default_sandbox()
    if mode.startswith("namespace") and not namespaces_available():
        raise RuntimeError(f"sandbox={mode!r}: network namespaces (unshare) do not work here")
    prelude = _AUDIT_PRELUDE if mode.endswith("audit") else _PLAIN_PRELUDE
    with tempfile.TemporaryDirectory(prefix="dsbd-humaneval-") as work:
        folder = Path(work)
        program = folder / "program.py"
        program.write_text(source)
        folder.chmod(0o755)  # readable by `nobody` after the privilege drop
        program.chmod(0o644)
        command = [sys.executable, "-I", "-S", "-c", prelude, str(program), str(timeout_s)]
        if mode.startswith("namespace"):
            if os.geteuid() == 0:
                drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
                command = ["unshare", "-n", "--", *drop, "--", *command]
            else:
                command = ["unshare", "-rn", "--", *command]
        return _run(command, folder, timeout_s)


def check_completion(
    problem: dict[str, str],
    completion: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    sandbox: SandboxMode | None = None,
) -> ExecutionResult:
    """Run a (truncated) completion against a HumanEval problem's tests."""
    source = program_text(problem["prompt"], completion, problem["test"], problem["entry_point"])
    return run_program(source, timeout_s=timeout_s, sandbox=sandbox)


def _run(command: list[str], cwd: Path, timeout_s: float) -> ExecutionResult:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        return ExecutionResult("timeout", f"no result within {timeout_s:g} s")
    tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
    if process.returncode == 0:
        return ExecutionResult("passed", "")
    return ExecutionResult("failed", " | ".join(tail) or f"exit status {process.returncode}")


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the child and everything it started (its own session), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()
