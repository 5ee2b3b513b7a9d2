"""Running the `dsbd serve` application: start a loopback-only local Ray, deploy, serve, stop.

The command line (flags, reading and validating the Serve config file) is dsbd/serve_command.py;
it hands this module an already validated Serve config (ServeDeploySchema: one or more
applications, each `import_path: deployments.app:build_app` with `args` = `AppArgs`, or
`deployments.llm_serving:build_openai_app` with Ray Serve LLM's `llm_configs`, optional
per-deployment overrides) and `ServeOptions`. Ray is started only through
`deployments.local_ray` (see there for why), models are prepared once here before the replicas
load them, and Ctrl-C / SIGTERM shut Serve and Ray down, leaving nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_IMPORT_PATH = "deployments.app:build_app"
LLM_IMPORT_PATH = "deployments.llm_serving:build_openai_app"  # Ray Serve LLM's shape


def application_models(app: Any) -> list[Any]:
    """The `AppArgs` of each model a Serve config application deploys (its own shape, or Ray
    Serve LLM's `llm_configs`); [] for an application of another import path."""
    if app.import_path == DEFAULT_IMPORT_PATH:
        from deployments.app import AppArgs

        return [AppArgs.model_validate(app.args or {})]
    if app.import_path == LLM_IMPORT_PATH:
        from deployments.llm_serving import serving_args

        return serving_args(app.args or {})
    return []


class ServeSetupError(Exception):
    """A model of the config cannot be served (unknown source, bad tensor-parallel split):
    found before any replica starts; the message names the application and the field."""


@dataclass(frozen=True)
class ServeOptions:
    """How to serve, besides the Serve config: checked by the caller before Ray starts."""

    host: str = "127.0.0.1"
    port: int = 8000
    num_cpus: float | None = None  # CPUs Ray may schedule on (default: all)
    metrics_port: int = 0  # Prometheus port of Ray's metrics agent (0: a free one)
    ready_file: Path | None = None  # once running, {"url", "pid", "metrics_url"} written here
    timeout: float = 600.0  # seconds to wait for the deployments
    # Ray's object store, touched at start (deployments/local_ray.py); 0: Ray's default size.
    # What serving puts there: calls and replies over 100 KiB, mainly the forests in flight
    # (a draft's proposals with their distributions, ~width x depth x vocab x 4 bytes each):
    # ~20 MiB at once under 32 clients on the embedded pair. A larger need is still served
    # (Ray then allocates the rest from files in its session folder), only slower.
    object_store_mib: int = 512
    # Redis for the GCS's tables, and the GCS started again when it dies (deployments/gcs_ft.py)
    gcs_redis: Any = None


def prepare_models(schema: Any) -> None:
    """Convert preset / GGUF models once, here, instead of in every replica at once.

    Raises ServeSetupError naming the application (and the field for tensor parallelism).
    """
    for app in schema.applications:
        for args in application_models(app):
            _prepare(app.name, args)


def _prepare(name: str, args: Any) -> None:
    """One model's pair, converted and checked (ServeSetupError naming the field)."""
    from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT
    from dsbd_core.models.errors import ModelSourceError
    from dsbd_core.models.sources import prepare_source

    for side, model in (("target", args.target), ("draft", args.draft)):
        if side == "draft" and model.source == LOOKUP_DRAFT:
            continue  # the prompt-lookup draft: no weights to prepare
        try:
            prepare_source(model.source)  # presets and GGUF converted once, here
        except ModelSourceError as error:
            allowed = f"; or {LOOKUP_DRAFT!r} (the prompt-lookup draft)" * (side == "draft")
            where = f"{name}.args.{side}.source={model.source!r}"
            raise ServeSetupError(f"{where}: {error}{allowed}") from None
        if model.tp_size > 1:  # refused here, before any replica starts
            from dsbd_core.models.tensor_parallel import (
                TensorParallelError,
                check_split,
                model_config,
            )

            try:
                check_split(model_config(model.source), model.tp_size)
            except TensorParallelError as error:
                where = f"{name}.args.{side}.tp_size={model.tp_size}"
                raise ServeSetupError(f"{where}: {error}") from None


def serve(schema: Any, options: ServeOptions) -> int:
    """Start Ray, deploy every application of `schema`, serve until Ctrl-C / SIGTERM, stop.

    Returns the exit status: 0 after a requested stop, 1 when the applications failed or were
    not running within `options.timeout`.
    """
    from ray.serve._private import api as serve_api

    from deployments.local_ray import metrics_url, start_local_ray, stop_local_ray
    from deployments.replicas.allocator import serve_controller_options

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # a shell starts background jobs (`dsbd serve &`, nohup) with SIGINT ignored, and Python
    # then never raises KeyboardInterrupt: `kill -INT` left the server running. Ctrl-C stops it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    start_local_ray(
        num_cpus=options.num_cpus,  # type: ignore[arg-type]  # --num-cpus is a float; Ray's stub says int
        namespace="serve",
        metrics_export_port=options.metrics_port,
        object_store_mib=options.object_store_mib,
        gcs_redis=options.gcs_redis,
    )
    watch = None
    if options.gcs_redis is not None:
        from deployments.gcs_ft import GcsWatch

        watch = GcsWatch().start()
        where = options.gcs_redis.address
        print(f"dsbd: Ray's GCS keeps its tables in Redis at {where}", flush=True)
    # ray.init installs Ray's own SIGTERM handler (log a stack, abort): a SIGTERM (Kubernetes,
    # systemd, kill) then killed this process mid-way and left Ray's agents running. Ours again.
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        configured = schema.controller_options  # a ServeDeploySchema field (None: not set)
        client = serve_api.serve_start(
            http_options=schema.http_options.model_dump(),
            proxy_location=schema.proxy_location,
            controller_options=serve_controller_options(
                configured.model_dump(exclude_none=True) if configured is not None else None
            ),
        )
        client.deploy_apps(schema, _blocking=False)
        names = [app.name for app in schema.applications]
        if not _wait_running(client, names, options.timeout, stopping):
            return 1
        url = f"http://{options.host}:{options.port}"
        for app in schema.applications:
            print(
                f"dsbd: application {app.name!r} ready at {url}{app.route_prefix or ''}", flush=True
            )
        metrics = metrics_url()
        print(f"dsbd: Prometheus metrics at {metrics}", flush=True)
        if options.ready_file is not None:  # for scripts: where to connect, whom to signal
            ready = {"url": url, "pid": os.getpid(), "metrics_url": metrics}
            options.ready_file.write_text(json.dumps(ready))
        print("dsbd: serving; Ctrl-C stops it", flush=True)
        while not stopping:
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        print("dsbd: shutting down", flush=True)
        if watch is not None:
            watch.stop()
        stop_local_ray(shut_serve_down=watch is None or not watch.outages)
        if watch is not None and (ended := watch.end_leftovers()):
            print(f"dsbd: stopped what outlived Ray's shutdown: {', '.join(ended)}", flush=True)


def _wait_running(client: Any, names: list[str], timeout: float, stopping: list) -> bool:
    """Poll every second until every application runs, one has failed, or `timeout` passes.

    Polled through the controller's status overviews (`list_serve_statuses`: an application's
    status and message), not `serve.status()`, which builds every deployment's whole details
    on the client (cloudpickling each request-router class): on the tests' six-application
    server 0.37 CPU-s of this process per call against 0.001 (Serve's controller: 0.023
    against 0.001; benchmarks/results/suite_time_epyc.json, "ready_polling")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping:
        overviews = {
            overview.name: overview.app_status for overview in client.list_serve_statuses()
        }
        states = {n: overviews[n].status if n in overviews else "NOT_STARTED" for n in names}
        failed = [n for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            for name in failed:
                print(
                    f"dsbd: application {name!r} failed: {overviews[name].message}", file=sys.stderr
                )
            return False
        if all(s == "RUNNING" for s in states.values()):
            return True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if not stopping:
        print(f"dsbd: the applications were not running after {timeout:.0f} s", file=sys.stderr)
    return False
