"""`dsbd serve` and `dsbd ray-env`: the flags, the Serve config file, the loopback settings.

The config is a Ray Serve config file (the schema `serve run` / `serve deploy` read: one or more
applications, each `import_path: deployments.app:build_app` with `args` = `AppArgs`, optional
per-deployment overrides); without `--config` the embedded defaults are served. Every flag and
the whole config are validated here (exit 2 naming the field) before any Ray process starts;
deployments.local_serve then prepares the models, starts Ray and serves.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from deployments.local_ray import OBJECT_STORE_MINIMUM_MIB
from deployments.local_serve import DEFAULT_IMPORT_PATH, LLM_IMPORT_PATH
from dsbd.common import fail, ray_cpus
from dsbd_core.algorithm.config import config_error_message


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd serve` (argparse only: Ray loads when serving)."""
    serve = commands.add_parser(
        "serve",
        help="serve the HTTP API (OpenAI-compatible + native) on a local, loopback-only Ray",
        description="Start Ray on loopback, deploy router, draft, verifier and session registry "
        "(Ray Serve), print the URL and serve until Ctrl-C.",
    )
    add_arguments(serve)


def add_ray_env_parser(commands: argparse._SubParsersAction) -> None:
    """Register `dsbd ray-env` (no flags)."""
    commands.add_parser(
        "ray-env",
        help="print NAME=value settings that keep a Ray you start yourself on loopback "
        "(env $(dsbd ray-env) serve run serve_config.yaml)",
    )


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of `dsbd serve`."""
    serve.add_argument("--config", type=Path, help="Serve config YAML (default: embedded models)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    serve.add_argument("--num-cpus", type=ray_cpus, default=None, help="CPUs Ray may schedule on")
    serve.add_argument(
        "--ready-file",
        type=Path,
        help='once every application runs, write {"url": ..., "pid": ...} (JSON) here',
    )
    serve.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the deployments"
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="Prometheus port of Ray's metrics agent, serving /metrics on 127.0.0.1 "
        "(default 0: a free port, printed and written to --ready-file)",
    )
    serve.add_argument(
        "--object-store-mib",
        type=int,
        default=512,
        metavar="MIB",
        help="size of Ray's shared object store, all of it reserved at start so Ray's memory "
        "stays flat (default 512; 0: Ray's default, 30%% of RAM, reserved as used)",
    )
    serve.add_argument(
        "--tp-size",
        type=int,
        default=None,
        metavar="N",
        help="shard every application's target over N tensor-parallel ranks "
        "(overrides target.tp_size of the config)",
    )
    serve.add_argument(
        "--draft",
        default=None,
        metavar="SOURCE",
        help="every application's draft (overrides draft.source of the config): a preset, "
        "directory, .gguf file or hub id, or 'ngram': the prompt-lookup draft (no weights)",
    )
    serve.add_argument(
        "--layout",
        choices=("auto", "split", "colocated"),
        default=None,
        help="every application's layout (overrides layout of the config): split, a Router, a "
        "Draft and a Verifier deployment; colocated, one Pair deployment owning both models and "
        "the decode loops; auto (the default): colocated when the target is on cuda without "
        "tensor parallelism. Without --config, the embedded models run on cuda when a GPU is "
        "visible",
    )
    serve.add_argument(
        "--ngram-max",
        type=int,
        default=None,
        metavar="N",
        help="the prompt-lookup draft's longest matched suffix, 1..16 (overrides "
        "draft.variant.ngram_max of the config)",
    )

    serve.add_argument(
        "--gcs-redis",
        default=os.environ.get("DSBD_GCS_REDIS"),
        metavar="HOST:PORT",
        help="keep Ray's GCS tables in this Redis and start the GCS again when it dies, without "
        "losing the replicas or a request (password from $DSBD_GCS_REDIS_PASSWORD; default "
        "$DSBD_GCS_REDIS; unset: the GCS keeps them in memory, and its loss is the cluster's)",
    )
    serve.add_argument(
        "--gcs-namespace",
        default=None,
        metavar="NAME",
        help="this cluster's keys in that Redis (default: dsbd)",
    )


def print_ray_env() -> int:
    """`dsbd ray-env`: NAME=value lines that keep a Ray started by someone else on loopback.

    For `serve run serve_config.yaml`, which starts Ray itself with a plain `ray.init()`:
    `env $(dsbd ray-env) serve run serve_config.yaml` scopes them to that one command (HOME
    points at a fresh folder holding Ray's bootstrap config, see deployments.local_ray).
    """
    from deployments.local_ray import loopback_environment, ray_process_settings

    for name, value in (loopback_environment() | ray_process_settings()).items():
        print(f"{name}={shlex.quote(value)}")
    return 0


def load_config(
    path: Path | None,
    host: str,
    port: int,
    tp_size: int | None = None,
    *,
    draft: str | None = None,
    ngram_max: int | None = None,
    layout: str | None = None,
) -> Any:
    """The validated Serve config (ServeDeploySchema); exits with a clear message if bad.
    `tp_size`, `draft`, `ngram_max` and `layout` (the flags) override every application's."""
    from ray.serve.schema import ServeDeploySchema

    if path is None:
        raw: dict[str, Any] = {
            "applications": [
                {
                    "name": "dsbd",
                    "route_prefix": "/",
                    "import_path": DEFAULT_IMPORT_PATH,
                    "args": embedded_args(layout),
                }
            ]
        }
    else:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            message = f"--config {str(path)!r}: cannot read it as YAML: {error}"
            raise SystemExit(fail(message)) from None
    raw["http_options"] = {**raw.get("http_options", {}), "host": host, "port": port}
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as error:
        raise SystemExit(fail(f"--config: {config_error_message(error)}")) from None
    from deployments.app import AppArgs

    for app in schema.applications:
        if app.import_path == LLM_IMPORT_PATH:
            _check_llm_configs(app, tp_size, draft, ngram_max, layout)
        if app.import_path == DEFAULT_IMPORT_PATH:
            if tp_size is not None:  # the flag wins over the file
                args = dict(app.args or {})
                target = AppArgs().target.model_dump() | dict(args.get("target") or {})
                app.args = args | {"target": target | {"tp_size": tp_size}}
            if draft is not None or ngram_max is not None:
                app.args = _with_draft(dict(app.args or {}), draft, ngram_max)
            if layout is not None:
                app.args = dict(app.args or {}) | {"layout": layout}
            try:
                AppArgs.model_validate(app.args or {})
            except ValidationError as error:
                message = config_error_message(error).replace("\n", f"\n  {app.name}.args.")
                raise SystemExit(fail(f"--config: {app.name}.args.{message}")) from None
    return schema


def _check_llm_configs(
    app: Any, tp_size: int | None, draft: str | None, ngram_max: int | None, layout: str | None
) -> None:
    """An application in Ray Serve LLM's shape, the flags written into every model's
    engine_kwargs, validated (exit 2 naming the field)."""
    from deployments.llm_serving import serving_args

    args = dict(app.args or {})
    flags: dict[str, Any] = {"tensor_parallel_size": tp_size, "layout": layout}
    speculative = {"model": draft, "prompt_lookup_max": ngram_max}
    if any(v is not None for v in (*flags.values(), *speculative.values())):
        configs = []
        for entry in args.get("llm_configs") or []:
            if isinstance(entry, str):  # a path: its mapping, to write the flags into
                try:
                    entry = yaml.safe_load(Path(entry).read_text()) or {}
                except (OSError, yaml.YAMLError) as error:
                    message = f"--config: {app.name}.args.llm_configs: {entry!r}: {error}"
                    raise SystemExit(fail(message)) from None
            kwargs = dict(entry.get("engine_kwargs") or {})
            kwargs |= {k: v for k, v in flags.items() if v is not None}
            given = {k: v for k, v in speculative.items() if v is not None}
            if given:
                kwargs["speculative_config"] = dict(kwargs.get("speculative_config") or {}) | given
            configs.append({**entry, "engine_kwargs": kwargs})
        app.args = args | {"llm_configs": configs}
    try:
        serving_args(app.args or {})
    except ValueError as error:
        raise SystemExit(fail(f"--config: {app.name}.args.{error}")) from None


def embedded_args(layout: str | None = None) -> dict[str, Any]:
    """The embedded application's args: both models on the GPU when one is visible (one Pair
    replica owns them: `layout: auto`; `--layout split`: the draft and the verifier share the
    GPU, half each), else the defaults (CPU, the split layout)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    from deployments.app import AppArgs

    defaults = AppArgs()
    cuda = {"device": "cuda"}
    share = 0.5 if layout == "split" else 1.0
    return {
        "target": defaults.target.model_dump() | cuda,
        "draft": defaults.draft.model_dump() | cuda,
        "verifier_resources": defaults.verifier_resources.model_dump() | {"num_gpus": share},
        "draft_resources": defaults.draft_resources.model_dump() | {"num_gpus": 0.5},
    }


def _with_draft(args: dict[str, Any], source: str | None, ngram_max: int | None) -> dict:
    """An application's args with the draft the flags name."""
    from deployments.app import AppArgs

    draft = AppArgs().draft.model_dump() | dict(args.get("draft") or {})
    if source is not None:
        draft["source"] = source
    if ngram_max is not None:
        draft["variant"] = dict(draft.get("variant") or {}) | {"ngram_max": ngram_max}
    return args | {"draft": draft}


def run(args: argparse.Namespace) -> int:
    """`dsbd serve`: validate the flags and the config, prepare the models, then serve."""
    from deployments.local_serve import ServeOptions, ServeSetupError, prepare_models, serve

    if args.tp_size is not None and args.tp_size < 1:
        raise SystemExit(fail(f"--tp-size={args.tp_size}: must be >= 1"))
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(fail(f"--metrics-port={args.metrics_port}: allowed 0..65535"))
    if args.object_store_mib != 0 and args.object_store_mib < OBJECT_STORE_MINIMUM_MIB:
        message = (
            f"--object-store-mib={args.object_store_mib}: allowed 0 (Ray's default size) "
            f"or >= {OBJECT_STORE_MINIMUM_MIB} (Ray's minimum)"
        )
        raise SystemExit(fail(message))
    gcs_redis = None
    if args.gcs_redis:
        from deployments.gcs_ft import GcsRedis, GcsRedisError

        try:
            gcs_redis = GcsRedis.parse(args.gcs_redis, args.gcs_namespace)
            gcs_redis.check()
        except GcsRedisError as error:
            raise SystemExit(fail(str(error))) from None
    elif args.gcs_namespace:
        raise SystemExit(fail(f"--gcs-namespace={args.gcs_namespace!r}: needs --gcs-redis"))
    schema = load_config(
        args.config,
        args.host,
        args.port,
        args.tp_size,
        draft=args.draft,
        ngram_max=args.ngram_max,
        layout=args.layout,
    )
    try:
        prepare_models(schema)
    except ServeSetupError as error:
        raise SystemExit(fail(str(error))) from None
    options = ServeOptions(
        host=args.host,
        port=args.port,
        num_cpus=args.num_cpus,
        metrics_port=args.metrics_port,
        ready_file=args.ready_file,
        timeout=args.timeout,
        object_store_mib=args.object_store_mib,
        gcs_redis=gcs_redis,
    )
    return serve(schema, options)
