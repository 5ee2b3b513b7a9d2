"""`dsbd.bench.smaps_census` counts glibc's thread arenas by their shape, not by alignment alone:
a thread that mallocs gets an arena whose heap starts at a multiple of 64 MiB with the rest of
those 64 MiB reserved behind it, and `MALLOC_ARENA_MAX` caps them (test_local_ray checks Ray's
metrics agent with this count). An anonymous mapping that merely starts at such a multiple (a
buffer, a stack, pymalloc's arenas land there by chance) is not an arena."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, json, mmap, os, threading
from dsbd.bench.smaps_census import ARENA_ALIGN, census

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
# an anonymous read-write mapping of 2 MiB at a multiple of 64 MiB, with nothing reserved behind:
# placed inside a reservation of our own, whose rest is then given back
SIZE, SPAN, MAP_FIXED = 2 << 20, 4 * ARENA_ALIGN, 0x10  # Linux's MAP_FIXED (not in 3.11's mmap)
base = libc.mmap(None, SPAN, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
hint = (base // ARENA_ALIGN + 1) * ARENA_ALIGN
aligned = libc.mmap(hint, SIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1, 0)
assert aligned == hint, (aligned, hint)
libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(hint - base))
libc.munmap(ctypes.c_void_p(hint + SIZE), ctypes.c_size_t(base + SPAN - hint - SIZE))
ctypes.memset(aligned, 1, SIZE)
ready, done = threading.Barrier(THREADS + 1), threading.Event()

def work():
    libc.malloc(1 << 16)  # a thread's first malloc takes it an arena while they are under the cap
    ready.wait()
    done.wait()

threads = [threading.Thread(target=work) for _ in range(THREADS)]
for thread in threads:
    thread.start()
ready.wait()
print(json.dumps(census(os.getpid()).get("malloc_arenas", {"count": 0})))
done.set()
"""


@pytest.mark.parametrize(("arena_max", "expected"), [("16", 4), ("2", 1)])
def test_thread_arenas_are_counted_and_an_aligned_mapping_is_not(arena_max: str, expected: int):
    env = dict(os.environ, MALLOC_ARENA_MAX=arena_max)
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("THREADS", "4")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    arenas = json.loads(completed.stdout.splitlines()[-1])
    assert arenas["count"] == expected, arenas
