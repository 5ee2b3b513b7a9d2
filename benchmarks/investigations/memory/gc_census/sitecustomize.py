"""What Python's cycle collector frees in Serve's HTTP-side processes, sampled under load.

A diagnostic, never loaded by the server itself: put this directory first on `PYTHONPATH` of a
`dsbd serve` (or of `dsbd bench soak`, which passes its environment on), and every Python
process Ray starts imports it at start-up (`site` imports `sitecustomize`). In the processes
whose command line names one of `GC_CENSUS_WATCH` (default: the ingress, the routers and
Serve's HTTP proxy) a thread, every `GC_CENSUS_PERIOD` seconds (default 90), collects with
`gc.DEBUG_SAVEALL` and writes one JSON line to `GC_CENSUS_OUT/NAME_PID.jsonl`: how many objects
the collection found unreachable, the most frequent types and descriptions (a frame's function,
a coroutine's name, a dict's first keys), the size of the oldest generation before it, and
the full collections Python ran on its own since the last line (time, objects collected).

Why: the ingress's memory climbed for ~9 minutes and dropped by 6-36 MiB at once under the
soak's load (docs/history/RELIABILITY-chronicle.md section 10). Reference cycles freed only by the
oldest
generation's collection would look like that; this tells whether they do. (They did not: a
few hundred objects per 90 s, and a 33 MiB drop with no collection behind it.)

    mkdir -p /tmp/gc_census
    PYTHONPATH=benchmarks/investigations/memory/gc_census \\
        GC_CENSUS_OUT=/tmp/gc_census \\
        .venv/bin/dsbd bench soak --duration 540 --window 300 \\
        --out /tmp/gc_census/soak.json

`GC_CENSUS_MODE=heap` asks instead where Python's own heap grows: the watched processes trace
their allocations (`tracemalloc`, `GC_CENSUS_FRAMES` frames each, default 8) and every period
write what is live, by traceback, against the first snapshot taken `GC_CENSUS_BASELINE`
seconds after start (default 300: after the soak's warm-up) and against the previous one, with
the traced total beside the process's RSS and private memory: growth the traces do not hold is
native (a C extension, gRPC, the allocator). Why: Ray's node metrics agent (DashboardAgent)
grew +2.1 % in PSS in the ninth soak (docs/history/RELIABILITY-chronicle.md section 10); it is a
Python process.

    GC_CENSUS_MODE=heap GC_CENSUS_WATCH=dashboard/agent.py \\
        PYTHONPATH=benchmarks/investigations/memory/gc_census \\
        GC_CENSUS_OUT=/tmp/heap_census .venv/bin/dsbd bench soak --duration 1200 \\
        --window 600 --out /tmp/heap_census/soak.json

`GC_CENSUS_MODE=allocators` asks which allocator holds the pages, without tracing (so the
process's own RSS stays comparable): every period one line with pymalloc's arenas (allocated,
bytes in allocated and in available blocks, from `sys._debugmallocstats`), glibc's `mallinfo2`
(bytes from the system in the heap and in mmaps, in use, free), the live objects by type (the
25 commonest and the total) and RSS/anon. Why: the agent's growth sat in anonymous mappings
outside the brk heap (smaps_census.py beside this folder), where pymalloc's arenas and
malloc's large chunks both live.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("GC_CENSUS_OUT", "/tmp/gc_census"))
WATCH = tuple(os.environ.get("GC_CENSUS_WATCH", "Ingress,Router,ProxyActor").split(","))
PERIOD_S = float(os.environ.get("GC_CENSUS_PERIOD", "90"))
MODE = os.environ.get("GC_CENSUS_MODE", "cycles")  # or "heap", "allocators"
FRAMES = int(os.environ.get("GC_CENSUS_FRAMES", "8"))
BASELINE_S = float(os.environ.get("GC_CENSUS_BASELINE", "300"))
_automatic: list[tuple[float, int]] = []  # full collections Python ran itself: (time, collected)


def _command_line() -> str:
    """Ray renames a replica's process (`ray::ServeReplica:dsbd:Ingress`) after it starts."""
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _describe(thing: Any) -> str:
    """Enough of an object to tell which code made it."""
    kind = type(thing).__name__
    try:
        if kind == "frame":
            code = thing.f_code
            return f"frame {code.co_filename.split('site-packages/')[-1]}:{code.co_name}"
        if kind == "traceback":
            code = thing.tb_frame.f_code
            return f"traceback {code.co_filename.split('site-packages/')[-1]}:{code.co_name}"
        if kind in ("function", "coroutine"):
            return f"{kind} {thing.__qualname__}"
        if kind == "cell":
            return f"cell -> {type(thing.cell_contents).__name__}"
        if kind == "dict":
            return "dict keys " + ",".join(sorted(map(str, list(thing)[:6])))
    except (AttributeError, ValueError):  # an empty cell, a frame being torn down
        pass
    return f"{type(thing).__module__}.{kind}"


def _note_full_collection(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 2:
        _automatic.append((time.time(), info["collected"]))


def _census(name: str, command_line: str) -> None:
    gc.callbacks.append(_note_full_collection)
    path = OUT / f"{name}_{os.getpid()}.jsonl"
    while True:
        time.sleep(PERIOD_S)
        oldest = len(gc.get_objects(2))
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collection finds, to look at it
        found = gc.collect()
        types = Counter(type(thing).__name__ for thing in gc.garbage)
        described = Counter(_describe(thing) for thing in gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()  # now free it
        record = {
            "t": time.time(),
            "process": command_line[:120],
            "collected": found,
            "oldest_generation": oldest,
            "counts": gc.get_count(),
            "types": types.most_common(25),
            "described": described.most_common(60),
            "automatic_full": list(_automatic),
        }
        _automatic.clear()
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def _memory_kib() -> dict[str, int]:
    """The process's RSS and its private part (RssAnon) from /proc/self/status, in KiB."""
    wanted = {"VmRSS": "rss_kib", "RssAnon": "anon_kib"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            out[wanted[key]] = int(value.split()[0])
    return out


def _top(stats: list[tracemalloc.StatisticDiff], count: int = 30) -> list[dict[str, Any]]:
    """The largest growths, each with its traceback's innermost frames (site-packages trimmed)."""
    rows = sorted(stats, key=lambda stat: stat.size_diff, reverse=True)[:count]
    return [
        {
            "size_diff": stat.size_diff,
            "size": stat.size,
            "count_diff": stat.count_diff,
            "count": stat.count,
            "where": [
                f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
                for frame in stat.traceback
            ],
        }
        for stat in rows
    ]


def _heap(name: str, command_line: str, started: float) -> None:
    """Where Python's live heap grows: tracebacks against a baseline and the previous period."""
    path = OUT / f"heap_{name.replace('/', '_')}_{os.getpid()}.jsonl"
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    baseline: tracemalloc.Snapshot | None = None
    baseline_t: float | None = None  # when it was taken: the first period past BASELINE_S
    previous: tracemalloc.Snapshot | None = None
    while True:
        time.sleep(PERIOD_S)
        snapshot = tracemalloc.take_snapshot().filter_traces(ignore)
        if baseline is None and time.time() - started >= BASELINE_S:
            baseline, baseline_t = snapshot, time.time()
        current, peak = tracemalloc.get_traced_memory()
        record = {
            "t": time.time(),
            "process": command_line[:120],
            "traced": current,
            "traced_peak": peak,
            "tracing_overhead": tracemalloc.get_tracemalloc_memory(),
            **_memory_kib(),
            "baseline_t": baseline_t,
            "since_baseline": []
            if baseline is None
            else _top(snapshot.compare_to(baseline, "traceback")),
            "since_previous": []
            if previous is None
            else _top(snapshot.compare_to(previous, "traceback"), 15),
        }
        previous = snapshot
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def _pymalloc() -> dict[str, int]:
    """pymalloc's arena figures: `sys._debugmallocstats` writes them to the C stderr, which is
    pointed at a file for the call (another thread's stderr in that instant lands there too)."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode(errors="replace")
    out = {}
    for line in text.splitlines():
        match = re.match(
            r"# (arenas allocated current|bytes in allocated blocks|"
            r"bytes in available blocks|arenas highwater mark)\s*=\s*([\d,]+)",
            line,
        )
        if match:
            out[match[1].replace(" ", "_")] = int(match[2].replace(",", ""))
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> dict[str, int]:
    """glibc's view (all arenas): `arena` bytes from the system for the heaps, `hblkhd` in
    mmaps of their own, `uordblks` in use, `fordblks` free but held."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:  # glibc before 2.33
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {name: getattr(info, name) for name in ("arena", "hblkhd", "uordblks", "fordblks")}


def _allocators(name: str, command_line: str) -> None:
    """Which allocator's pages grow: pymalloc's arenas, glibc's heaps or mmaps, which objects."""
    path = OUT / f"allocators_{name.replace('/', '_')}_{os.getpid()}.jsonl"
    while True:
        time.sleep(PERIOD_S)
        objects = Counter(type(thing).__name__ for thing in gc.get_objects())
        record = {
            "t": time.time(),
            "process": command_line[:120],
            **_memory_kib(),
            "pymalloc": _pymalloc(),
            "glibc": _glibc(),
            "objects": objects.total(),
            "types": objects.most_common(25),
        }
        del objects
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def _watched(command_line: str) -> str | None:
    return next((watched for watched in WATCH if watched in command_line), None)


def _start(name_at_start: str | None) -> None:
    started = time.time()
    time.sleep(20)  # Ray names the process once the replica's actor is created
    command_line = _command_line()  # Ray's agents rename themselves too (ray::DashboardAgent)
    name = name_at_start or _watched(command_line)
    if name is None:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if MODE == "heap":
        if name_at_start is None:
            tracemalloc.start(FRAMES)
        _heap(name, command_line, started)
    elif MODE == "allocators":
        _allocators(name, command_line)
    else:
        _census(name, command_line)


# A process whose command line already names what is watched (Ray's agents, not a replica Ray
# renames later) traces its heap from its first allocation.
_name_at_start = _watched(_command_line()) if MODE in ("heap", "allocators") else None
if _name_at_start is not None and MODE == "heap":
    tracemalloc.start(FRAMES)
threading.Thread(target=_start, args=(_name_at_start,), daemon=True, name="gc-census").start()
