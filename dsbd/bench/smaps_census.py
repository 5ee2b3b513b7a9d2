"""Where a process's resident memory lies, by kind of mapping, sampled over time: to tell which
allocator's pages grow when a process's RSS creeps with no Python object behind it.

Why: Ray's DashboardAgent grew +1.5-2 MiB (PSS +2.1 %) over the last 20 minutes of 30-minute
soaks while its Python heap (tracemalloc) grew a fifth of that,
so what grows is native memory (docs/history/RELIABILITY-chronicle.md section 10). The agent runs
glibc's malloc
(Ray strips its jemalloc preload from the processes the raylet starts); glibc gives every
thread that allocates an arena of its own (mmap'd, 64 MiB-aligned), up to 8 per core, and the
main thread's arena is the `[heap]` (brk). Python's small objects live in pymalloc's 1 MiB
arenas (anonymous mmaps) and big buffers in mmaps of their own. So `/proc/PID/smaps` split by
mapping says whose pages grew:

- `heap`: glibc's main arena; `malloc_arenas`: the heaps of the threads' arenas (anonymous, rw,
  starting at a multiple of 64 MiB, and with the rest of those 64 MiB reserved right after them
  as an inaccessible mapping, or grown over all of them: glibc reserves a heap's whole 64 MiB
  and opens it as the arena grows; an anonymous mapping that merely starts aligned is not one);
  `stacks`: 8 MiB anonymous mappings behind a guard page; `anon`: every other
  anonymous mapping (pymalloc arenas, large mallocs); `files`: file-backed (code, data of
  libraries); `shmem`: shared memory (Ray's object store).

    # beside a soak: the first process with an argument ending in --match, every 60 s
    .venv/bin/python -m dsbd.bench.smaps_census --match dashboard/agent.py \\
        --match ray::DashboardAgent --out census.jsonl
    .venv/bin/python -m dsbd.bench.smaps_census --report census.jsonl --window 1200

Ray's agents rename themselves (`ray::DashboardAgent`) once started, hence the two --match;
a process matched once is followed by pid. The report is the growth of each kind over the last
`--window` seconds, computed as `dsbd bench soak` computes a process's (the mean of the
window's last three samples against that of its first three).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from dsbd.bench import soak

FIELDS = ("Rss", "Pss", "Anonymous", "Private_Dirty")
ARENA_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena starts at a multiple


def kind(
    start: int, size: int, perms: str, path: str, previous_guard: bool, reserved_to: int = 0
) -> str:
    """The kind of one mapping (see the module docstring); `reserved_to` is the end of the
    inaccessible anonymous mapping right after it (0 if none follows)."""
    if path == "[heap]":
        return "heap"
    if path.startswith("[stack"):
        return "stacks"
    if path.startswith("/dev/shm") or path.startswith("/SYSV") or "(deleted)" in path:
        return "shmem"
    if path.startswith("/") or path.startswith("[v"):
        return "files"
    if perms.startswith("rw") and start % ARENA_ALIGN == 0:
        if size == ARENA_ALIGN or (size < ARENA_ALIGN and reserved_to == start + ARENA_ALIGN):
            return "malloc_arenas"
    if perms.startswith("rw") and previous_guard and size >= 8 << 20:
        return "stacks"
    return "anon"


def census(pid: int) -> dict[str, dict[str, int]]:
    """kB per kind and field of `pid`'s mappings now, with a count of mappings per kind."""
    mappings: list[tuple[int, int, str, str, dict[str, int]]] = []
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                low, high = (int(part, 16) for part in head[0].split("-"))
                path = head[5].strip() if len(head) > 5 else ""
                mappings.append((low, high, head[1], path, dict.fromkeys(FIELDS, 0)))
            elif mappings and head[0].rstrip(":") in FIELDS:
                mappings[-1][4][head[0].rstrip(":")] += int(head[1])
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys((*FIELDS, "count"), 0))
    previous_guard = False
    for at, (low, high, perms, path, fields) in enumerate(mappings):
        after = mappings[at + 1] if at + 1 < len(mappings) else None
        reserved = after and after[0] == high and after[2].startswith("---") and not after[3]
        reserved_to = after[1] if after and reserved else 0
        current = totals[kind(low, high - low, perms, path, previous_guard, reserved_to)]
        current["count"] += 1
        for field, kib in fields.items():
            current[field] += kib
        previous_guard = perms.startswith("---") and not path
    return dict(totals)


def find(matches: list[str], timeout_s: float) -> psutil.Process:
    """The first process but this one with an argument ending in one of `matches` (the program
    it runs, or the title it took; the raylet's command line holds the agent's inside one
    argument), waited for up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["cmdline"]):
            arguments = process.info["cmdline"] or ()
            if process.pid != os.getpid() and any(a.endswith(tuple(matches)) for a in arguments):
                return process
        time.sleep(1.0)
    raise SystemExit(f"no process with {matches} in its command line within {timeout_s:.0f} s")


def watch(args: argparse.Namespace) -> None:
    """Sample the matched process every period until it exits (or --duration passes)."""
    process = find(args.match, args.wait)
    start = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        while process.is_running() and time.monotonic() - start < args.duration:
            try:
                row: dict[str, Any] = {"t": round(time.monotonic() - start, 1), "pid": process.pid}
                row["threads"] = process.num_threads()
                row["kinds"] = census(process.pid)
            except (psutil.Error, OSError):
                break
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(args.period)


def report(path: Path, window_s: float) -> dict[str, Any]:
    """Growth per kind and field over the last window_s of the samples in `path`, as
    `dsbd bench soak` reports a process's (`soak.growth`: first/last/max in kB or mappings as
    counted, the growth as a fraction, a slope per hour)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    window = [row for _, row in soak.last_window([(row["t"], row) for row in rows], window_s)]
    times = [row["t"] for row in window]
    names = sorted({name for row in window for name in row["kinds"]})
    kinds = {
        name: {
            field: soak.growth(
                times, [row["kinds"].get(name, {}).get(field, 0) for row in window], 1
            )
            for field in (*FIELDS, "count")
        }
        for name in names
    }
    threads = (window[0]["threads"], window[-1]["threads"])
    return {"window_s": [times[0], times[-1]], "threads": threads, "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--match", action="append", help="how an argument of the watched process ends (repeatable)"
    )
    parser.add_argument("--out", type=Path, help="JSON lines written, one per sample")
    parser.add_argument("--period", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for it")
    parser.add_argument("--duration", type=float, default=float("inf"), help="seconds at most")
    parser.add_argument("--report", type=Path, help="print the growth in this census")
    parser.add_argument("--window", type=float, default=1200.0, help="seconds, with --report")
    args = parser.parse_args(argv)
    if args.report:
        print(json.dumps(report(args.report, args.window), indent=1))
        return 0
    if not args.match or not args.out:
        parser.error("--match and --out are needed to watch (or --report FILE)")
    watch(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
