"""A `redis-server` on loopback for the GCS's tables: `dsbd bench chaos --kill gcs` and the tests.

Started with a password and its append-only file on, as KubeRay's high-availability sample
runs Redis, so that a Redis stopped and started again in the same folder comes back with what
the GCS wrote to it. Needs Redis's own server binary (Debian: `apt install redis-server`;
.ci/run installs it).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deployments.gcs_ft import GcsRedis, GcsRedisError
from dsbd.server_process import free_port


@dataclass
class LocalRedis:
    """One redis-server process (restartable in place: same port, folder and password)."""

    folder: Path
    port: int
    password: str
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> None:
        command = [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--requirepass",
            self.password,
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--save",
            "",
        ]
        log = (self.folder / "redis.log").open("a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        redis = GcsRedis(self.address, self.password)
        while True:
            try:
                redis.check(timeout=1.0)
                return
            except GcsRedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: Redis writes its append-only file and exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.process = None


@contextlib.contextmanager
def local_redis(folder: Path) -> Iterator[LocalRedis]:
    """A password-protected Redis on a free loopback port, stopped afterwards."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (Debian: apt install redis-server)")
    folder.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis(folder, free_port(), secrets.token_hex(8))
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()
