"""`dsbd serve --gcs-redis` before Ray starts (deployments/gcs_ft.py): a misnamed or silent Redis,
or a wrong password, is a clear error naming the flag (exit 2), checked against a real
`redis-server` on loopback. The GCS killed and restarted under load:
tests/serving/test_gcs_ft.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deployments.gcs_ft import PASSWORD_ENV, GcsRedis, GcsRedisError
from dsbd.bench.local_redis import local_redis
from dsbd.server_process import free_port
from tests.support.serving_harness import REPO

DSBD = [sys.executable, "-m", "dsbd"]


@pytest.mark.parametrize(
    ("address", "namespace", "fragment"),
    [
        ("localhost", None, "--gcs-redis='localhost': allowed HOST:PORT"),
        ("127.0.0.1:http", None, "--gcs-redis='127.0.0.1:http': allowed HOST:PORT"),
        ("127.0.0.1:70000", None, "--gcs-redis='127.0.0.1:70000': allowed HOST:PORT"),
        ("127.0.0.1:6379", "a b", "--gcs-namespace='a b': allowed letters, digits, '-' and '_'"),
    ],
)
def test_a_misnamed_redis_is_refused_naming_the_flag(address, namespace, fragment) -> None:
    with pytest.raises(GcsRedisError) as error:
        GcsRedis.parse(address, namespace)
    assert fragment in str(error.value)


def test_the_redis_is_asked_with_its_password_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Redis: the right password answers; a wrong or missing one, and an address where
    nothing listens, are errors naming the flag (the password's source for a refused one)."""
    with local_redis(tmp_path / "redis") as redis:
        monkeypatch.setenv(PASSWORD_ENV, redis.password)
        good = GcsRedis.parse(redis.address, "test")
        good.check()
        assert good.environment()["RAY_REDIS_ADDRESS"] == redis.address
        assert good.environment()["RAY_external_storage_namespace"] == "test"
        assert redis.password not in repr(good)  # never printed with the settings
        for password in ("wrong", ""):
            monkeypatch.setenv(PASSWORD_ENV, password)
            with pytest.raises(GcsRedisError, match=rf"--gcs-redis={redis.address}: Redis says"):
                GcsRedis.parse(redis.address).check()
    silent = f"127.0.0.1:{free_port()}"
    with pytest.raises(GcsRedisError, match=rf"--gcs-redis={silent}: no Redis answers"):
        GcsRedis(silent).check(timeout=2)


@pytest.mark.slow  # a `dsbd` process: imports torch, transformers and Ray
def test_dsbd_serve_exits_2_for_a_redis_it_cannot_use() -> None:
    silent = f"127.0.0.1:{free_port()}"
    for flags, fragment in (
        (["--gcs-redis", silent], f"--gcs-redis={silent}: no Redis answers"),
        (["--gcs-namespace", "x"], "--gcs-namespace='x': needs --gcs-redis"),
    ):
        done = subprocess.run(
            [*DSBD, "serve", *flags], capture_output=True, text=True, timeout=120, cwd=REPO
        )
        assert done.returncode == 2, done.stderr
        assert fragment in done.stderr, done.stderr
        assert "ray" not in done.stdout.lower()
