"""`dsbd serve` configuration handling: config errors exit 2 naming the field before any Ray
process starts, and the shipped `serve_config.yaml` validates. No test here starts Ray (those
that serve are tests/serving/test_serve_run.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.app import AppArgs
from deployments.deployment_options import (
    SERVE_DEFAULTS,
    Resources,
    resources_from_serve_options,
)
from dsbd.cli import main
from dsbd.serve_command import load_config
from tests.support.tp_harness import save_tiny

REPO = Path(__file__).parents[2]
DSBD = [sys.executable, "-m", "dsbd"]


def test_the_shipped_serve_config_is_valid_and_matches_the_defaults() -> None:
    schema = load_config(REPO / "serve_config.yaml", "127.0.0.1", 8000)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert (args.target.source, args.draft.source) == (
        AppArgs().target.source,
        AppArgs().draft.source,
    )
    assert args.verifier_resources.max_replicas > args.verifier_resources.min_replicas


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"target": {"source": "smollm2", "dtype": "float8"}}, "target.dtype='float8'"),
        ({"draft_resources": {"max_replicas": 0}}, "draft_resources.max_replicas=0"),
        (
            {"draft_resources": {"min_replicas": 3, "max_replicas": 2}},
            "draft_resources: min_replicas=3 > max_replicas=2; allowed: min_replicas <= max",
        ),
        ({"widht": 3}, "widht"),
        ({"target": {"source": "/no/such/model"}}, "/no/such/model"),
        (
            {"router_resources": {"serve_options": {"graceful_shutdown_timeout_s": -1}}},
            "serve_options.graceful_shutdown_timeout_s=-1",
        ),
        ({"draft_resources": {"serve_options": {"name": "x"}}}, "serve_options.name"),
        (
            {"router_resources": {"max_ongoing_requests": 8}},
            "max_ongoing_requests: a Ray Serve option dsbd has no field for; give it as "
            "serve_options.max_ongoing_requests",
        ),
    ],
)
def test_bad_configs_exit_2_naming_the_field(
    tmp_path: Path, args: dict, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsbd serve --config` run in this process (`dsbd.cli.main`, what the console script
    calls; test_tp_size_is_checked_against_the_model_before_ray_starts runs the process)."""
    import ray

    app = {
        "name": "dsbd",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": args,
    }
    config = {"applications": [app]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(path)])
    captured = capsys.readouterr()
    assert exited.value.code == 2, captured.err
    assert fragment in captured.err
    assert not ray.is_initialized() and "ray" not in captured.out.lower()  # before Ray started


@pytest.mark.slow  # a `dsbd` process: imports torch, transformers and Ray
def test_tp_size_is_checked_against_the_model_before_ray_starts(tmp_path: Path) -> None:
    model = save_tiny("llama", tmp_path / "m", heads=4, kv_heads=2)
    app = {
        "name": "dsbd",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": {"target": {"source": str(model)}, "draft": {"source": str(model)}},
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [app]}))
    for flag, fragment in [
        ("3", "dsbd.args.target.tp_size=3: tp_size=3 does not split llama num_attention_heads=4"),
        ("0", "--tp-size=0: must be >= 1"),
    ]:
        done = subprocess.run(
            [*DSBD, "serve", "--config", str(path), "--tp-size", flag],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert done.returncode == 2, done.stderr
        assert fragment in done.stderr
        assert "ray" not in done.stdout.lower()


@pytest.mark.slow  # a `dsbd` process: imports torch, transformers and Ray
def test_an_object_store_below_rays_minimum_exits_2_before_ray_starts() -> None:
    """`--object-store-mib` (Ray's shared store, touched at start: deployments/local_ray.py)
    takes 0 (Ray's default size) or Ray's minimum of 75 MiB and more."""
    done = subprocess.run(
        [*DSBD, "serve", "--object-store-mib", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert "--object-store-mib=10: allowed 0 (Ray's default size) or >= 75" in done.stderr
    assert "ray" not in done.stdout.lower()


@pytest.mark.parametrize(("given", "why"), [("2.5", "'2.5'"), ("0", "0")])
def test_num_cpus_of_the_local_ray_is_a_whole_number(
    given: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray refuses fractional node resources with a traceback once it starts; the flag is
    checked first (exit 2, naming it)."""
    from dsbd.cli import main as dsbd_main

    with pytest.raises(SystemExit) as exited:
        dsbd_main(["serve", "--num-cpus", given])
    assert exited.value.code == 2
    assert f"argument --num-cpus: {why}: allowed: a whole number >= 1" in capsys.readouterr().err


def test_tp_size_gives_the_verifier_a_placement_group_of_ranks() -> None:
    schema = load_config(REPO / "serve_config.yaml", "127.0.0.1", 8000, tp_size=2)
    args = AppArgs.model_validate(schema.applications[0].args)
    assert args.target.tp_size == 2 and args.draft.tp_size == 1
    options = args.verifier_resources.options(args.target)
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in args.draft_resources.options(args.draft)
    gpu = AppArgs.model_validate(
        {"target": {"source": "smollm2", "device": "cuda", "tp_size": 4, "threads": 2}}
    )
    bundles = gpu.verifier_resources.options(gpu.target)["placement_group_bundles"]
    assert bundles[1:] == [{"CPU": 2.0, "GPU": 1.0}] * 4
    with pytest.raises(ValueError, match=r"verifier_resources.num_gpus=1.0 with target.tp_size=2"):
        AppArgs.model_validate(
            {"target": {"source": "smollm2", "tp_size": 2}, "verifier_resources": {"num_gpus": 1}}
        )
    with pytest.raises(ValueError, match=r"target.device='cuda' needs verifier_resources.num_gpus"):
        AppArgs.model_validate({"target": {"source": "smollm2", "device": "cuda"}})


def test_tp_init_timeout_defaults_to_two_hours_and_must_be_positive() -> None:
    """Ranks that load a large model minutes apart must still meet at the barrier after it."""
    assert AppArgs().target.tp_init_timeout_s == 7200.0
    args = AppArgs.model_validate({"target": {"source": "smollm2", "tp_init_timeout_s": 900}})
    assert args.target.tp_init_timeout_s == 900.0
    with pytest.raises(ValueError, match=r"target.tp_init_timeout_s\n.*greater than 0"):
        AppArgs.model_validate({"target": {"source": "smollm2", "tp_init_timeout_s": 0}})


def _printed(stdout: str) -> dict[str, str]:
    """The NAME=VALUE settings `dsbd ray-env` printed."""
    return dict(line.split("=", 1) for line in stdout.split())


@pytest.mark.slow  # a `dsbd` process: imports torch, transformers and Ray
def test_ray_env_prints_the_loopback_settings() -> None:
    done = subprocess.run([*DSBD, "ray-env"], capture_output=True, text=True, timeout=60)
    settings = _printed(done.stdout)
    assert settings["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert settings["RAY_prestart_worker_first_driver"] == "0"  # no idle workers prestarted
    assert (Path(settings["HOME"]) / "ray_bootstrap_config.yaml").is_file()
    shutil.rmtree(settings["HOME"])  # the printed HOME outlives `dsbd ray-env` for `serve run`
    assert settings["MALLOC_ARENA_MAX"] == "2"  # Ray's glibc processes (deployments.local_ray)
    assert settings["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"  # Serve's controller's walk
    # the user's own memory settings, controller interval and worker prestart win, as in
    # `dsbd serve`
    mine = {
        **os.environ,
        "MALLOC_ARENA_MAX": "4",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2",
        "RAY_prestart_worker_first_driver": "1",
    }
    done = subprocess.run([*DSBD, "ray-env"], capture_output=True, text=True, timeout=60, env=mine)
    shutil.rmtree(_printed(done.stdout)["HOME"])
    assert "MALLOC_ARENA_MAX=4" in done.stdout.split(), done.stdout
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.2" in done.stdout.split(), done.stdout
    assert "RAY_prestart_worker_first_driver=1" in done.stdout.split(), done.stdout


def test_serve_options_pass_through_to_serve_over_dsbds_own() -> None:
    """Any Serve deployment option dsbd has no field for reaches Serve as given (checked by
    Serve's schema) over dsbd's values for it; a mapping merges into what dsbd sets."""
    scaled = Resources(
        min_replicas=1,
        max_replicas=3,
        serve_options={
            "graceful_shutdown_timeout_s": 60,
            "max_queued_requests": 200,
            "autoscaling_config": {"upscale_delay_s": 5},
            "ray_actor_options": {"max_restarts": 2},
        },
    ).options(kind="router")
    assert scaled["graceful_shutdown_timeout_s"] == 60 and scaled["max_queued_requests"] == 200
    assert scaled["autoscaling_config"]["upscale_delay_s"] == 5
    assert scaled["autoscaling_config"]["max_replicas"] == 3  # dsbd's stays beside it
    assert scaled["ray_actor_options"] == {"num_cpus": 1.0, "max_restarts": 2}
    assert scaled["max_ongoing_requests"] == SERVE_DEFAULTS["router"]["max_ongoing_requests"]
    mine = Resources(serve_options={"max_ongoing_requests": 8, "health_check_period_s": 1})
    assert mine.options(kind="draft")["max_ongoing_requests"] == 8
    assert mine.options(kind="draft")["health_check_period_s"] == 1
    fixed = Resources(max_replicas=3, serve_options={"autoscaling_config": {"upscale_delay_s": 5}})
    assert fixed.options()["autoscaling_config"]["min_replicas"] == 1  # autoscaling asked for
    assert "num_replicas" not in fixed.options()
    with pytest.raises(ValueError, match="serve_options.bogus: not a Ray Serve deployment option"):
        Resources(serve_options={"bogus": 1})


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"num_replicas": 2}, "min_replicas = max_replicas"),
        ({"autoscaling_config": {"max_replicas": 4}}, "max_replicas"),
        ({"autoscaling_config": {"target_ongoing_requests": 2}}, "target_ongoing_requests"),
        ({"ray_actor_options": {"num_cpus": 2}}, "num_cpus"),
        ({"ray_actor_options": {"num_gpus": 1}}, "num_gpus"),
        ({"ray_actor_options": {"resources": {"x": 1}}}, "resources"),
    ],
)
def test_a_serve_option_a_field_owns_is_refused_in_serve_options(given: dict, field: str) -> None:
    """One route per Serve option: what dsbd's typed fields set is refused in serve_options,
    naming the field to use."""
    with pytest.raises(ValueError, match=f"set by dsbd's field {re.escape(field)}; give it there"):
        Resources(serve_options=given)


def test_ray_serve_llm_deployment_options_land_on_their_routes() -> None:
    """Ray Serve LLM's `deployment_config` holds all of Serve's options: what a typed field owns
    moves to it, the rest stays in serve_options, and the result is the same Serve options."""
    given = {
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 0.5, "max_restarts": 1},
        "max_ongoing_requests": 16,
    }
    fields = resources_from_serve_options(given)
    assert fields == {
        "min_replicas": 2,
        "max_replicas": 2,
        "num_cpus": 0.5,
        "serve_options": {"ray_actor_options": {"max_restarts": 1}, "max_ongoing_requests": 16},
    }
    options = Resources(**fields).options(kind="verifier")
    assert options["num_replicas"] == 2 and options["max_ongoing_requests"] == 16
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "max_restarts": 1}
    scaled = resources_from_serve_options({"autoscaling_config": {"max_replicas": 3, "x": 1}})
    assert scaled == {"max_replicas": 3, "serve_options": {"autoscaling_config": {"x": 1}}}
