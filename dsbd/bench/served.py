"""The server and the requests the serving benchmarks share (`dsbd bench serve`; the served
iteration cost investigation launches its applications with `launch`): `dsbd serve` started
through dsbd/server_process.py and stopped as a user stops it, one native request timed by the
client, and the same requests one by one against all at once.

Ray, the server launcher and the HTTP client are imported where they are used: `dsbd --help`
imports this module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def start_server(
    workdir: Path, port: int, batch_wait_s: float, target: str, draft: str
) -> tuple[subprocess.Popen, dict]:
    """`dsbd serve` on the pair (served as model `target`), one torch thread per model, on few
    CPUs; returns the process and its ready file's info (url, pid)."""
    models = {"threads": 1, "batch_wait_s": batch_wait_s}
    args = {
        "model_name": target,
        "target": {"source": target, **models},
        "draft": {"source": draft, **models},
        "router_resources": {"num_cpus": 0.1},
        "draft_resources": {"num_cpus": 0.5},
        "verifier_resources": {"num_cpus": 1},
    }
    app = {
        "name": "dsbd",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": args,
    }
    return launch(workdir, port, [app])


def launch(workdir: Path, port: int, applications: list[dict]) -> tuple[subprocess.Popen, dict]:
    """`dsbd serve --config` with these Serve applications (dsbd/server_process.py; log in
    workdir/server.log); returns the process and its ready file's info (url, pid)."""
    import yaml

    from dsbd import server_process

    config = workdir / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": applications}))
    server = server_process.start(workdir, config, num_cpus=4, port=port, timeout_s=600)
    return server.process, {"url": server.base_url, "pid": server.pid}


def stop_server(process: subprocess.Popen, pid: int, wait_s: float = 180.0) -> None:
    """SIGINT to `dsbd serve`, as a user stops it; waits for it to exit."""
    os.kill(pid, signal.SIGINT)
    process.wait(timeout=wait_s)


def http_decode(url: str, prompt_ids: list[int], knobs: dict, max_new: int, seed: int) -> dict:
    """One native request (`adaptive: false` unless the knobs say otherwise); the reply with
    the client's seconds added."""
    import requests

    body = {
        "prompt_ids": prompt_ids,
        "seed": seed,
        "max_new_tokens": max_new,
        "adaptive": False,
        **knobs,
    }
    start = time.perf_counter()
    response = requests.post(f"{url}/v1/dsbd/generate", json=body, timeout=600)
    response.raise_for_status()
    out = response.json()
    out["client_seconds"] = time.perf_counter() - start
    return out


def chat_ids(tokenizer_source: str, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn of the pair's chat template, tokenised (no model loaded)."""
    from dsbd_core.models import load_tokenizer

    tokenizer, _ = load_tokenizer(tokenizer_source)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def throughput(
    url: str,
    prompts: list[list[int]],
    knobs: dict,
    max_new: int,
    seeds: list[int],
    concurrent_first: bool = False,
) -> tuple[float, float, list[int]]:
    """The prompts decoded one by one and all at once over HTTP, in that order or (with
    `concurrent_first`) the other: tokens per second of each, and the verifier batch sizes the
    concurrent requests saw."""
    tokens_per_s, batches = {}, []
    for mode in ("conc", "seq") if concurrent_first else ("seq", "conc"):
        start = time.perf_counter()
        if mode == "seq":
            pairs = zip(prompts, seeds, strict=True)
            outs = [http_decode(url, ids, knobs, max_new, s) for ids, s in pairs]
        else:
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [
                    pool.submit(http_decode, url, ids, knobs, max_new, s)
                    for ids, s in zip(prompts, seeds, strict=True)
                ]
                outs = [f.result() for f in futures]
            batches = [b for o in outs for b in o["stats"]["serving"]["verify_batch_requests"]]
        tokens = sum(o["stats"]["tokens_emitted"] for o in outs)
        tokens_per_s[mode] = tokens / (time.perf_counter() - start)
    return tokens_per_s["seq"], tokens_per_s["conc"], batches
