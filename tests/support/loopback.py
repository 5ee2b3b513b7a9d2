"""Whom a process tree reached: the tests that run Ray or a `dsbd serve` under `strace -f`
(`strace`, the prefix) read every address a traced process tried (`peers`) and check that each is
loopback (`is_loopback`)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from dsbd import server_process

ADDRESS = re.compile(r'inet_(?:addr|pton)\((?:AF_INET6?, )?"([^"]+)"')


strace = server_process.strace_prefix  # the prefix every traced test runs under


def peers(trace_dir: Path) -> set[str]:
    """Every IP address any traced process tried to reach."""
    found: set[str] = set()
    for path in trace_dir.iterdir():
        for line in path.read_text(errors="replace").splitlines():
            found.update(ADDRESS.findall(line))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback over IPv6 sockets
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
