"""`dsbd serve`: start a loopback-only local Ray, deploy the application, print the URL.

The config is a Ray Serve config file (the schema `serve run` / `serve deploy` read: one or more
applications, each `import_path: deployments.app:build_app` with `args` = `AppArgs`, optional
per-deployment overrides); without `--config` the embedded defaults are served. Ray is started
only through `deployments.local_ray` (see there for why), models are prepared once here before
the replicas load them, and Ctrl-C / SIGTERM shut Serve and Ray down, leaving nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dsbd_core.algorithm.config import config_error_message

DEFAULT_IMPORT_PATH = "deployments.app:build_app"


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--config", type=Path, help="Serve config YAML (default: embedded models)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    serve.add_argument("--num-cpus", type=float, default=None, help="CPUs Ray may schedule on")
    serve.add_argument(
        "--ready-file",
        type=Path,
        help='once every application runs, write {"url": ..., "pid": ...} (JSON) here',
    )
    serve.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the deployments"
    )
    serve.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT",
        help="Prometheus port of Ray's metrics agent, serving /metrics on 127.0.0.1 "
        "(default 0: a free port, printed and written to --ready-file)",
    )  # fmt: skip
    serve.add_argument(
        "--tp-size", type=int, default=None, metavar="N",
        help="shard every application's target over N tensor-parallel ranks "
        "(overrides target.tp_size of the config)",
    )  # fmt: skip


def print_ray_env() -> int:
    """`dsbd ray-env`: NAME=value lines that keep a Ray started by someone else on loopback.

    For `serve run serve_config.yaml`, which starts Ray itself with a plain `ray.init()`:
    `env $(dsbd ray-env) serve run serve_config.yaml` scopes them to that one command (HOME
    points at a fresh folder holding Ray's bootstrap config, see deployments.local_ray).
    """
    from deployments.local_ray import loopback_environment

    for name, value in loopback_environment().items():
        print(f"{name}={shlex.quote(value)}")
    return 0


def load_config(path: Path | None, host: str, port: int, tp_size: int | None = None) -> Any:
    """The validated Serve config (ServeDeploySchema); exits with a clear message if bad."""
    from ray.serve.schema import ServeDeploySchema

    if path is None:
        raw: dict[str, Any] = {
            "applications": [{"name": "dsbd", "route_prefix": "/",
                              "import_path": DEFAULT_IMPORT_PATH, "args": {}}]
        }  # fmt: skip
    else:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            message = f"--config {str(path)!r}: cannot read it as YAML: {error}"
            raise SystemExit(_fail(message)) from None
    raw["http_options"] = {**raw.get("http_options", {}), "host": host, "port": port}
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as error:
        raise SystemExit(_fail(f"--config: {config_error_message(error)}")) from None
    from deployments.app import AppArgs

    for app in schema.applications:
        if app.import_path == DEFAULT_IMPORT_PATH:
            if tp_size is not None:  # the flag wins over the file
                args = dict(app.args or {})
                target = AppArgs().target.model_dump() | dict(args.get("target") or {})
                app.args = args | {"target": target | {"tp_size": tp_size}}
            try:
                AppArgs.model_validate(app.args or {})
            except ValidationError as error:
                message = config_error_message(error).replace("\n", f"\n  {app.name}.args.")
                raise SystemExit(_fail(f"--config: {app.name}.args.{message}")) from None
    return schema


def prepare_models(schema: Any) -> None:
    """Convert preset / GGUF models once, here, instead of in every replica at once."""
    from deployments.app import AppArgs
    from dsbd_core.models import ModelSourceError, resolve_source
    from dsbd_core.models.tensor_parallel import TensorParallelError, check_split, model_config

    for app in schema.applications:
        if app.import_path != DEFAULT_IMPORT_PATH:
            continue
        args = AppArgs.model_validate(app.args or {})
        for side, model in (("target", args.target), ("draft", args.draft)):
            try:
                resolve_source(model.source)
                if model.tp_size > 1:  # refused here, before any replica starts
                    check_split(model_config(model.source), model.tp_size)
            except ModelSourceError as error:
                raise SystemExit(_fail(f"{app.name}: {error}")) from None
            except TensorParallelError as error:
                where = f"{app.name}.args.{side}.tp_size={model.tp_size}"
                raise SystemExit(_fail(f"{where}: {error}")) from None


def main(args: argparse.Namespace) -> int:
    if args.tp_size is not None and args.tp_size < 1:
        raise SystemExit(_fail(f"--tp-size={args.tp_size}: must be >= 1"))
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(_fail(f"--metrics-port={args.metrics_port}: allowed 0..65535"))
    schema = load_config(args.config, args.host, args.port, args.tp_size)
    prepare_models(schema)
    from ray import serve
    from ray.serve._private import api as serve_api

    from deployments.local_ray import metrics_url, start_local_ray, stop_local_ray

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    start_local_ray(num_cpus=args.num_cpus, namespace="serve",
                    metrics_export_port=args.metrics_port)  # fmt: skip
    # ray.init installs Ray's own SIGTERM handler (log a stack, abort): a SIGTERM (Kubernetes,
    # systemd, kill) then killed this process mid-way and left Ray's agents running. Ours again.
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        client = serve_api.serve_start(
            http_options=schema.http_options.model_dump(),
            proxy_location=schema.proxy_location,
        )
        client.deploy_apps(schema, _blocking=False)
        names = [app.name for app in schema.applications]
        if not _wait_running(serve, names, args.timeout, stopping):
            return 1
        url = f"http://{args.host}:{args.port}"
        for app in schema.applications:
            print(f"dsbd: application {app.name!r} ready at {url}{app.route_prefix or ''}",
                  flush=True)  # fmt: skip
        metrics = metrics_url()
        print(f"dsbd: Prometheus metrics at {metrics}", flush=True)
        if args.ready_file is not None:  # for scripts: where to connect, whom to signal
            ready = {"url": url, "pid": os.getpid(), "metrics_url": metrics}
            args.ready_file.write_text(json.dumps(ready))
        print("dsbd: serving; Ctrl-C stops it", flush=True)
        while not stopping:
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        print("dsbd: shutting down", flush=True)
        stop_local_ray()


def _wait_running(serve: Any, names: list[str], timeout: float, stopping: list) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping:
        statuses = serve.status().applications
        states = {n: statuses[n].status if n in statuses else "NOT_STARTED" for n in names}
        failed = [n for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            for name in failed:
                print(f"dsbd: application {name!r} failed: {statuses[name].message}",
                      file=sys.stderr)  # fmt: skip
            return False
        if all(s == "RUNNING" for s in states.values()):
            return True
        time.sleep(1.0)
    if not stopping:
        print(f"dsbd: the applications were not running after {timeout:.0f} s", file=sys.stderr)
    return False


def _fail(message: str) -> int:
    print(f"dsbd: error: {message}", file=sys.stderr)
    return 2
