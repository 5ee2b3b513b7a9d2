"""Serving as users start it: Ray's own `serve run` of a config in Ray Serve LLM's shape, given
the settings `dsbd ray-env` prints, serves its models while contacting nothing but loopback
(traced like test_serving), and the README's main command (`dsbd serve`, no options) serves
the embedded models.

The README's server starts when the module does, and its first request is sent as soon as it is
ready: that request waits for the pair's served calibration (about 100 s of one core on the
2-core AMD EPYC, benchmarks/results/suite_time_epyc.json "readme_command_first_request"), which
so runs beside the other test's server instead of after it. Two Ray clusters run at once here,
each with its own ports, HOME and session folder (deployments/local_ray.py)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import yaml

from dsbd import server_process
from tests.support.loopback import is_loopback, peers, strace
from tests.support.serving_harness import free_port, stop
from tests.support.tiny_models import build_identity_pair

REPO = Path(__file__).parents[2]
DSBD = [sys.executable, "-m", "dsbd"]
README_TEST = "test_the_readme_main_command_serves_the_embedded_models"


def _readme_request(started: list[server_process.Server], root: Path) -> Any:
    """`dsbd serve` with no options, then the README test's request (the openai client)."""
    server = server_process.start(root, timeout_s=600, exit_on_sigterm=False)
    started.append(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=12,
        n=2,
        seed=0,
        extra_body={"width": 3, "gamma": 2},
    )


@pytest.fixture(scope="module", autouse=True)
def readme_reply(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Future | None, list[server_process.Server]]]:
    """The README test's server and reply, started in a thread when the module starts (where
    that test is selected); the test stops the server, or else the module's teardown does."""
    started: list[server_process.Server] = []
    if not any(item.name == README_TEST for item in request.session.items):
        yield None, started
        return
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_readme_request, started, tmp_path_factory.mktemp("readme"))
        try:
            yield reply, started
        finally:
            with contextlib.suppress(Exception):  # a start still under way ends first
                reply.result(timeout=900)
            for server in started:
                server_process.stop(server, signal.SIGTERM)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_serve_run_of_ray_serve_llms_shape_serves_two_models_on_loopback_only(
    tmp_path: Path,
) -> None:
    """A Serve config in Ray Serve LLM's shape (`llm_configs`, deployments/llm_serving.py), two
    models behind one OpenAI ingress: a tiny pair as `tiny` (DSBD, split layout) and the same
    target as `tiny-beam` (the prompt-lookup draft, beam sampling by default, co-located).
    The pair's target is its draft with layers that add nothing and cost ten times the draft
    (`build_identity_pair`): the served cost model, calibrated through the deployments, must
    draft on it."""
    target, draft = build_identity_pair(tmp_path / "models")
    port = free_port()
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/",
                "import_path": "deployments.llm_serving:build_openai_app",
                "args": {
                    "llm_configs": [
                        {
                            "model_loading_config": {
                                "model_id": "tiny",
                                "model_source": str(target),
                            },
                            "engine_kwargs": {
                                "speculative_config": {
                                    "model": str(draft),
                                    "num_speculative_tokens": 2,
                                }
                            },
                            "deployment_config": small,
                        },
                        {
                            "model_loading_config": {
                                "model_id": "tiny-beam",
                                "model_source": str(target),
                            },
                            "engine_kwargs": {
                                "speculative_config": {"method": "ngram"},
                                "method": "beam",
                                "width": 2,
                                "layout": "colocated",
                            },
                            "deployment_config": small,
                        },
                    ],
                    "ingress_deployment_config": small,
                },
            }
        ],
    }
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    printed = subprocess.run([*DSBD, "ray-env"], capture_output=True, text=True, timeout=60)
    env = {**os.environ, **dict(x.split("=", 1) for x in shlex.split(printed.stdout))}
    serve = Path(sys.executable).parent / "serve"
    trace = tmp_path / "trace"
    trace.mkdir()
    process = subprocess.Popen(
        [*strace(trace), str(serve), "run", str(tmp_path / "serve.yaml")],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "log").open("w"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            try:
                if requests.get(f"{url}/healthz", timeout=10).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or still deploying
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail((tmp_path / "log").read_text()[-3000:])
            time.sleep(2)
        listed = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [card["id"] for card in listed] == ["tiny", "tiny-beam"]
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for model in ("tiny", "tiny-beam"):
            reply = api.completions.create(model=model, prompt="one two", max_tokens=6, seed=1)
            assert reply.model == model and reply.choices
        methods = {}
        for model in ("tiny", "tiny-beam"):  # each model's own request defaults
            body = {"model": model, "prompt_ids": [5, 17, 42], "max_new_tokens": 6, "seed": 2}
            got = requests.post(f"{url}/v1/dsbd/generate", json=body, timeout=120).json()
            methods[model] = (got["method"], len(got["beams"]))
        assert methods == {"tiny": ("dsbd", 3), "tiny-beam": ("beam", 2)}
        # the adaptive path drafts where drafting pays: every drafted layer agrees, the target
        # costs ten drafts
        body = {"model": "tiny", "prompt_ids": [5, 17, 42], "max_new_tokens": 128, "seed": 3}
        got = requests.post(f"{url}/v1/dsbd/generate", json=body, timeout=300).json()
        gammas, stats = got["stats"]["serving"]["gamma"], got["stats"]
        assert max(gammas) > 0 and stats["accepted_tokens"] > 0, (gammas, stats)
        assert stats["target_passes_per_token"] < 1, stats
        layouts = {
            model: requests.get(f"{url}/v1/dsbd/status?model={model}", timeout=30).json()
            for model in ("tiny", "tiny-beam")
        }
        assert layouts["tiny"]["router"]["layout"] == "split"
        assert layouts["tiny"]["router"]["calibration"]["state"] == "measured"
        assert layouts["tiny-beam"]["router"]["layout"] == "colocated"
        assert layouts["tiny"]["verifier"]["pid"] != layouts["tiny-beam"]["verifier"]["pid"]
        body = {"model": "nope", "prompt": "one two", "max_tokens": 6}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 404
        assert "'nope' does not exist; available: 'tiny', 'tiny-beam'" in response.text
    finally:
        stop(process, lambda: os.killpg(process.pid, signal.SIGINT))
        shutil.rmtree(env["HOME"], ignore_errors=True)  # `dsbd ray-env`'s HOME, kept for Ray
    outside = sorted(a for a in peers(trace) if not is_loopback(a))
    assert not outside, f"serve run tried to reach: {outside}"


@pytest.mark.real_model
def test_the_readme_main_command_serves_the_embedded_models(readme_reply) -> None:
    """`dsbd serve` with no options: SmolLM2 + its draft, answering the openai client (the
    server and the request are `readme_reply`'s, started with the module)."""
    future, started = readme_reply
    try:
        reply = future.result(timeout=1200)
    except server_process.ServerStartError as error:
        pytest.fail(str(error))
    try:
        assert len(reply.choices) == 2 and reply.choices[0].message.content.strip()
        assert reply.usage.completion_tokens > 0
    finally:
        # SIGTERM, what Kubernetes and systemd send (the serving tests stop with SIGINT): Ray's
        # own handler once aborted the process mid-shutdown and left its agents running
        left = server_process.stop(started.pop(), signal.SIGTERM)
        assert not left, "the server left processes behind"
