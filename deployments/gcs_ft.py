"""Ray's GCS backed by Redis, and restarted when it dies: serving through the loss of Ray's head.

Ray's Global Control Service keeps the cluster's metadata (actors, placement groups, nodes,
jobs, Serve's checkpoints in its key-value store) in memory by default, so a GCS that dies
takes the whole cluster with it. With `RAY_REDIS_ADDRESS` set when the head starts, the GCS
writes that metadata through to Redis; a GCS started again on the same port reads it back, and
while it is down running actors and tasks keep going and existing objects stay readable: Serve
replicas keep answering, only actor and placement-group creation, resource management and
node registration wait (Ray's docs, "GCS fault tolerance"; KubeRay's `gcsFaultToleranceOptions`
is the same setting for a RayService).

On a KubeRay cluster the head pod's restart brings the GCS back. A local `dsbd serve` started
Ray itself (`ray.init` in its own process holds the head node), so here `GcsWatch` plays the
pod's part: it watches the GCS process and starts it again, on the same port and with the same
Redis, when it exits. Only with Redis: a GCS restarted without it would come up empty and the
raylet, reconnected to it, would be unknown to it.

`GcsRedis` is what `dsbd serve --gcs-redis` (or `DSBD_GCS_REDIS`) takes: Redis's loopback or
cluster address, the password from the environment (never a flag: flags show up in `ps`), and
the namespace that keeps this cluster's keys apart from other clusters' on the same Redis
(`RAY_external_storage_namespace`, KubeRay's `externalStorageNamespace`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The environment variable that holds the password (KubeRay's samples name theirs REDIS_PASSWORD
# and hand it to the head as RAY_REDIS_PASSWORD from a Secret).
PASSWORD_ENV = "DSBD_GCS_REDIS_PASSWORD"
DEFAULT_NAMESPACE = "dsbd"
# A GCS whose Redis stops answering retries each command this many times, up to a second apart,
# before it exits (Ray's default: 5 times within a fraction of a second): a Redis restarted in
# place (KubeRay's sample keeps its data on a volume) is ridden through, not a GCS restart.
REDIS_RETRIES = {"RAY_num_redis_request_retries": "60", "RAY_redis_retry_max_ms": "1000"}
# How often the watch looks at the GCS process: the outage is at least this long.
WATCH_INTERVAL_S = 0.2


class GcsRedisError(ValueError):
    """The Redis the GCS should use is misnamed or does not answer: said before Ray starts."""


@dataclass(frozen=True)
class GcsRedis:
    """Where the GCS keeps its tables: `host:port` of a Redis, its password, a namespace."""

    address: str
    password: str = field(default="", repr=False)
    namespace: str = DEFAULT_NAMESPACE

    @staticmethod
    def parse(address: str, namespace: str | None = None) -> GcsRedis:
        """From `--gcs-redis HOST:PORT` (the password from `PASSWORD_ENV`); GcsRedisError names
        what is wrong."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise GcsRedisError(f"--gcs-redis={address!r}: allowed HOST:PORT (e.g. 127.0.0.1:6379)")
        namespace = namespace or DEFAULT_NAMESPACE
        if not namespace.replace("-", "").replace("_", "").isalnum():
            raise GcsRedisError(
                f"--gcs-namespace={namespace!r}: allowed letters, digits, '-' and '_'"
            )
        return GcsRedis(address, os.environ.get(PASSWORD_ENV, ""), namespace)

    def environment(self) -> dict[str, str]:
        """What the head's processes read when Ray starts (the GCS, from its environment)."""
        return {
            "RAY_REDIS_ADDRESS": self.address,
            "RAY_external_storage_namespace": self.namespace,
            **REDIS_RETRIES,
        }

    def check(self, timeout: float = 5.0) -> None:
        """AUTH (with a password) and PING over Redis's own protocol, so that a wrong address or
        password is a clear error here and not a GCS that never comes up."""
        host, _, port = self.address.rpartition(":")
        commands = ([("AUTH", self.password)] if self.password else []) + [("PING",)]
        try:
            with socket.create_connection((host, int(port)), timeout=timeout) as conn:
                for command in commands:
                    conn.sendall(_command(*command))
                    reply = _reply(conn)
                    if reply.startswith(b"-"):
                        what = reply[1:].decode(errors="replace").strip()
                        hint = f" (the password comes from ${PASSWORD_ENV})"
                        raise GcsRedisError(f"--gcs-redis={self.address}: Redis says {what}{hint}")
        except OSError as error:
            raise GcsRedisError(f"--gcs-redis={self.address}: no Redis answers ({error})") from None


def _command(*words: str) -> bytes:
    """A Redis command as RESP's array of bulk strings."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _reply(conn: socket.socket) -> bytes:
    """One simple-string or error reply line (what AUTH and PING answer)."""
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = conn.recv(256)
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data


@dataclass
class Outage:
    """One loss of the GCS: when it was seen gone and how long until it listened again."""

    seen_at: float
    restarted_s: float


def _wait_listening(address: str, timeout: float = 60.0) -> None:
    """Until the GCS's port accepts a connection (it binds once its tables are read back)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.05)


class GcsWatch:
    """Starts the GCS again whenever its process exits (module docstring).

    Runs in the process that started Ray (it holds the head node). `outages` records each
    restart; a GCS that cannot be started again is reported once and left (the cluster is
    then lost, as without fault tolerance).
    """

    def __init__(self, interval: float = WATCH_INTERVAL_S) -> None:
        import ray

        node = ray._private.worker._global_node
        if node is None or not node.head:
            raise RuntimeError("GcsWatch runs in the process that started Ray's head node")
        self._node: Any = node
        self._before_shutdown: list[Any] = []
        self._interval: float = interval
        self._stop: threading.Event = threading.Event()
        self.outages: list[Outage] = []
        self._thread: threading.Thread = threading.Thread(
            target=self._run, name="dsbd-gcs-watch", daemon=True
        )

    def start(self) -> GcsWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before Ray is shut down: a GCS stopped on purpose stays stopped), and
        note the processes Ray runs now for `end_leftovers`."""
        self._stop.set()
        self._thread.join(timeout=10)
        import psutil

        self._before_shutdown = psutil.Process().children(recursive=True)

    def end_leftovers(self, grace_s: float = 5.0) -> list[str]:
        """After Ray's shutdown, end what of its processes still runs; their names.

        Only after a GCS restart: the raylet's agents, which normally exit with the raylet,
        then wait for a GCS to reconnect to (`gcs_rpc_server_reconnect_timeout_s`, 60 s)
        before they do, and Serve's replicas outlive Ray's shutdown (`dsbd serve` skips Serve's
        own shutdown then: the driver's GCS subscriptions are not renewed, it would wait 30 s
        for a controller exit it cannot hear). Nothing of the cluster is left to wait for:
        they are stopped here."""
        if not self.outages:
            return []
        import psutil

        left = [p for p in self._before_shutdown if p.is_running()]
        names = []
        for process in left:
            with contextlib.suppress(psutil.Error):
                names.append(process.name())
                process.terminate()
        _, alive = psutil.wait_procs(left, timeout=grace_s)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        return names

    def _process(self) -> Any:
        from ray._private import ray_constants

        infos = self._node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER) or []
        return infos[0].process if infos else None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            process = self._process()
            if process is None or process.poll() is None:
                continue
            seen = time.monotonic()
            print(f"dsbd: Ray's GCS exited ({process.returncode}); starting it again", flush=True)
            try:
                self._node.kill_gcs_server(check_alive=False)  # forget the dead process
                self._node.start_gcs_server()
            except Exception as error:  # noqa: BLE001 (reported; the cluster is lost without it)
                print(f"dsbd: Ray's GCS could not be started again: {error}", flush=True)
                return
            _wait_listening(self._node.gcs_address)
            outage = Outage(seen, time.monotonic() - seen)
            self.outages.append(outage)
            print(f"dsbd: Ray's GCS is back after {outage.restarted_s:.2f} s", flush=True)
