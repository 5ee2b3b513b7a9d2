"""What Python's cycle collector frees in Serve's HTTP-side processes, sampled under load.

A diagnostic, never loaded by the server itself: put this directory first on `PYTHONPATH` of a
`dsbd serve` (or of benchmarks/soak.py, which passes its environment on), and every Python
process Ray starts imports it at start-up (`site` imports `sitecustomize`). In the processes
whose command line names one of `GC_CENSUS_WATCH` (default: the ingress, the routers and
Serve's HTTP proxy) a thread, every `GC_CENSUS_PERIOD` seconds (default 90), collects with
`gc.DEBUG_SAVEALL` and writes one JSON line to `GC_CENSUS_OUT/NAME_PID.jsonl`: how many objects
the collection found unreachable, the most frequent types and descriptions (a frame's function,
a coroutine's name, a dict's first keys), the size of the oldest generation before it, and
the full collections Python ran on its own since the last line (time, objects collected).

Why: the ingress's memory climbed for ~9 minutes and dropped by 6-36 MiB at once under the
soak's load (docs/RELIABILITY.md section 10). Reference cycles freed only by the oldest
generation's collection would look like that; this tells whether they do. (They did not: a
few hundred objects per 90 s, and a 33 MiB drop with no collection behind it.)

    mkdir -p /tmp/gc_census
    PYTHONPATH=benchmarks/gc_census GC_CENSUS_OUT=/tmp/gc_census .venv/bin/python \\
        benchmarks/soak.py --duration 540 --window 300 --out /tmp/gc_census/soak.json
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("GC_CENSUS_OUT", "/tmp/gc_census"))
WATCH = tuple(os.environ.get("GC_CENSUS_WATCH", "Ingress,Router,ProxyActor").split(","))
PERIOD_S = float(os.environ.get("GC_CENSUS_PERIOD", "90"))
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
        record = {"t": time.time(), "process": command_line[:120], "collected": found,
                  "oldest_generation": oldest, "counts": gc.get_count(),
                  "types": types.most_common(25), "described": described.most_common(60),
                  "automatic_full": list(_automatic)}  # fmt: skip
        _automatic.clear()
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def _start() -> None:
    time.sleep(20)  # Ray names the process once the replica's actor is created
    command_line = _command_line()
    name = next((watched for watched in WATCH if watched in command_line), None)
    if name is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        _census(name, command_line)


threading.Thread(target=_start, daemon=True, name="gc-census").start()
