"""A pseudo-terminal for tests of what a command shows on a terminal (tests/batch/test_batch.py:
Ray Data draws progress bars only where `sys.stdout.isatty()`)."""

from __future__ import annotations

import os
import pty
import re
import threading


class Terminal:
    """A pseudo-terminal to stand in for sys.stdout or sys.stderr; a thread drains it (a full
    pty would block the writer). What Ray Data shows depends on `sys.stdout.isatty()`: bars
    (rich, on sys.stderr) on a terminal, periodic log lines otherwise."""

    def __init__(self) -> None:
        self.master, follower = pty.openpty()
        self.file = os.fdopen(follower, "w", buffering=1, encoding="utf-8", errors="replace")
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the other end was closed
                return
            if not data:
                return
            self.chunks.append(data)

    def text(self) -> str:
        """Everything written, without colours and cursor moves (close first)."""
        self.file.close()
        self.reader.join(timeout=10)
        os.close(self.master)
        raw = b"".join(self.chunks).decode("utf-8", errors="replace")
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw).replace("\r", "\n")
