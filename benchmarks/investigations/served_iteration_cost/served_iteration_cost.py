"""What Ray's calls of ONE served decode iteration cost, model compute excluded (issue 33, 8).

Why: on a GPU whose iteration is captured as CUDA graphs (~3-6 ms), the router -> draft ->
verifier calls could cost as much as the models. Two measurements, this CPU, 1 torch thread:

1. `served`: `dsbd serve` on *instant* models (1-layer Llamas, hidden size 8: a forward costs
   ~nothing) at two vocabularies, 320 (a few-KiB forest) and 49,152 (SmolLM2's: a 1.2 MB
   float32 forest at W = 3, gamma = 2). Per iteration, the router's seconds from sending its
   calls to holding the verifier's reply (`stats.serving.iteration_seconds`) minus the
   replicas' batch compute (`verify_seconds`, `draft_seconds`): beam sampling makes one call,
   DSBD two and moves the forest through the object store. Methods and vocabularies interleave.
2. `mechanisms`: the same two shapes (one call with a 4 KiB payload; draft -> forest ->
   verifier -> 4 KiB back) through Serve DeploymentHandles, plain Ray actor calls, a Ray
   compiled graph (`experimental_compile`) and plain in-process calls, methods interleaved.

Ray starts only through deployments/local_ray.py (loopback only).

    .venv/bin/python benchmarks/investigations/served_iteration_cost/served_iteration_cost.py \\
        [--part served|mechanisms|both]

Writes results/served_iteration_cost.json and .md beside this file. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))  # the repository, for tests/
from dsbd.bench.decode.harness import git_info  # noqa: E402
from dsbd.bench.served import launch  # noqa: E402
from tests.support.tiny_models import build_tokenizer  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "served_iteration_cost"
VOCABS = (320, 49_152)
LAYOUTS = ("split", "colocated")  # deployments/app.py `layout`
KNOBS = {
    "beam": {"method": "beam", "width": 3},
    "dsbd": {"method": "dsbd", "width": 3, "gamma": 2, "threshold": None},
}
SMALL = 4096  # bytes: an IterationCall or a VerifyReply ("a few KiB")
FORESTS = {
    "1.2 MB (SmolLM2 V, W=3, gamma=2, float32)": 2 * 3 * 49_152 * 4,
    "5.5 MB (Qwen2.5 V, W=3, gamma=3, float32)": 3 * 3 * 151_936 * 4,
}


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(p90, 3),
        "n": len(ordered),
    }


# ------------------------------------------------------------------ 1. the served path
def instant_pair(root: Path, vocab: int) -> tuple[Path, Path]:
    """A target and a draft (the target, slightly perturbed) whose forward costs ~nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target, draft = root / "target", root / "draft"
    tokenizer = build_tokenizer(target)
    tokenizer.save_pretrained(draft)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(target)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter) * parameter.std())
    model.save_pretrained(draft)
    return target, draft


def serve(workdir: Path, port: int) -> tuple[subprocess.Popen, str, int]:
    """`dsbd serve` with one application per layout and vocabulary (/split-v320, ...)."""
    apps = []
    for vocab in VOCABS:
        target, draft = instant_pair(workdir / f"v{vocab}", vocab)
        model = {"dtype": "float32", "threads": 1, "batch_wait_s": 0.01}
        for layout in LAYOUTS:
            apps.append(
                {
                    "name": f"{layout}-v{vocab}",
                    "route_prefix": f"/{layout}-v{vocab}",
                    "import_path": "deployments.app:build_app",
                    "args": {
                        "model_name": f"instant-{vocab}",
                        "layout": layout,
                        "target": {"source": str(target), **model},
                        "draft": {"source": str(draft), **model},
                        "router_resources": {"num_cpus": 0.1},
                        # scheduling labels only (every model runs 1 torch thread): four
                        # applications within the 4 CPUs `launch` gives Ray
                        "draft_resources": {"num_cpus": 0.25},
                        "verifier_resources": {"num_cpus": 0.5},
                    },
                }
            )
    process, info = launch(workdir, port, apps)
    return process, info["url"], info["pid"]


def served(rounds: int, max_new: int, port: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="dsbd-iteration-cost-"))
    process, url, pid = serve(workdir, port)
    cells = {
        f"{layout} {m} V={v}": {"calls": [], "wall": [], "compute": [], "bytes": 0}
        for v in VOCABS
        for m in KNOBS
        for layout in LAYOUTS
    }
    load = {"before": loadavg()}
    try:

        def decode(layout: str, vocab: int, method: str, seed: int, tokens: int) -> dict[str, Any]:
            body = {
                "prompt_ids": [5, 17, 42, 99, 7],
                "seed": seed,
                "max_new_tokens": tokens,
                "adaptive": False,
                **KNOBS[method],
            }
            route = f"{url}/{layout}-v{vocab}/v1/dsbd/generate"
            reply = requests.post(route, json=body, timeout=600)
            reply.raise_for_status()
            return reply.json()["stats"]

        order = [(layout, v, m) for v in VOCABS for m in KNOBS for layout in LAYOUTS]
        for layout, vocab, method in order:  # warm up: sessions, handles, the object store
            decode(layout, vocab, method, 0, 8)
        for rep in range(rounds):
            for layout, vocab, method in order if rep % 2 == 0 else order[::-1]:
                stats = decode(layout, vocab, method, rep + 1, max_new)
                s, cell = stats["serving"], cells[f"{layout} {method} V={vocab}"]
                # fixed knobs: every iteration drafts but the last ones (budget left: 1)
                n = len(s["draft_seconds"]) or len(s["verify_seconds"])
                drafts = s["draft_seconds"] or [0.0] * n
                rows = zip(s["iteration_seconds"][:n], s["verify_seconds"][:n], drafts, strict=True)
                for i, (total, verify, draft) in enumerate(rows):
                    if i > 0:  # the first iteration prefills and opens the caches
                        cell["calls"].append(1e3 * (total - verify - draft))
                        cell["compute"].append(1e3 * (verify + draft))
                compute = sum(s["verify_seconds"]) + sum(s["draft_seconds"])
                cell["wall"].append(1e3 * (s["wall_seconds"] - compute) / stats["iterations"])
                cell["bytes"] = 2 * 3 * vocab * 4 if method == "dsbd" else 0
    finally:
        load["after"] = loadavg()
        os.kill(pid, signal.SIGINT)
        process.wait(timeout=180)
    return {
        "load": load,
        "max_new_tokens": max_new,
        "rounds": rounds,
        "cells": {
            name: {
                "forest_bytes": c["bytes"],
                "calls_per_iteration": summary(c["calls"]),
                "replica_compute_per_iteration": summary(c["compute"]),
                "request_wall_minus_compute_per_iteration": summary(c["wall"]),
            }
            for name, c in cells.items()
        },
    }


# ------------------------------------------------------------------ 2. Ray's mechanisms
class Draft:
    def __init__(self) -> None:
        torch.set_num_threads(1)

    def propose(self, call: tuple[bytes, int]) -> torch.Tensor:
        return torch.ones(call[1] // 4, dtype=torch.float32)  # the forest's tables

    def beam(self, call: tuple[bytes, int]) -> bytes:
        return call[0]  # one call, a few KiB each way


class Verifier(Draft):
    def verify(self, forest: torch.Tensor) -> bytes:
        return bytes(SMALL) if forest.numel() else b""


def mechanisms(iterations: int, rounds: int) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.dag import InputNode

    from deployments.local_ray import start_local_ray, stop_local_ray

    torch.set_num_threads(1)
    start_local_ray(num_cpus=4, log_to_driver=False)
    load = {"before": loadavg()}
    try:
        local_draft, local_verifier = Draft(), Verifier()
        options = {"num_cpus": 0.1, "max_concurrency": 1}
        actor_draft = ray.remote(**options)(Draft).remote()
        actor_verifier = ray.remote(**options)(Verifier).remote()
        graph_draft = ray.remote(**options)(Draft).remote()
        graph_verifier = ray.remote(**options)(Verifier).remote()
        beam_draft = ray.remote(**options)(Draft).remote()
        with InputNode() as given:
            compiled_dsbd = graph_verifier.verify.bind(graph_draft.propose.bind(given))
        compiled_dsbd = compiled_dsbd.experimental_compile()
        with InputNode() as given:
            compiled_beam = beam_draft.beam.bind(given).experimental_compile()
        serve.start(proxy_location="Disabled")
        sdraft, sverifier = (
            serve.run(
                serve.deployment(cls, name=name, ray_actor_options={"num_cpus": 0.1}).bind(),
                name=name,
                route_prefix=None,
            )
            for name, cls in (("draft", Draft), ("verifier", Verifier))
        )

        dsbd: dict[str, Callable[[Any], Any]] = {
            "in_process": lambda c: local_verifier.verify(local_draft.propose(c)),
            "ray_actor": lambda c: ray.get(
                actor_verifier.verify.remote(actor_draft.propose.remote(c))
            ),
            "compiled_graph": lambda c: ray.get(compiled_dsbd.execute(c)),
            "serve_handle": lambda c: sverifier.verify.remote(sdraft.propose.remote(c)).result(),
        }
        beam: dict[str, Callable[[Any], Any]] = {
            "in_process": local_draft.beam,
            "ray_actor": lambda c: ray.get(actor_draft.beam.remote(c)),
            "compiled_graph": lambda c: ray.get(compiled_beam.execute(c)),
            "serve_handle": lambda c: sdraft.beam.remote(c).result(),
        }
        shapes = {"beam (1 call, 4 KiB each way)": (beam, 0)}
        shapes.update({f"dsbd (2 calls + forest {k})": (dsbd, n) for k, n in FORESTS.items()})
        times: dict[str, dict[str, list[float]]] = {s: {m: [] for m in beam} for s in shapes}
        for rep in range(rounds + 1):  # round 0 warms up and is dropped
            for shape, (calls, forest) in shapes.items():
                order = list(calls) if rep % 2 else list(calls)[::-1]
                for method in order:
                    call = (bytes(SMALL), forest)
                    for _ in range(iterations):
                        start = time.perf_counter()
                        calls[method](call)
                        if rep:
                            times[shape][method].append(1e3 * (time.perf_counter() - start))
        for graph in (compiled_dsbd, compiled_beam):  # a plain teardown() hung here
            graph.teardown(kill_actors=True)
    finally:
        load["after"] = loadavg()
        stop_local_ray()
    return {
        "load": load,
        "iterations_per_round": iterations,
        "rounds": rounds,
        "ray": ray.__version__,
        "cells": {
            shape: {m: summary(v) for m, v in cells.items()} for shape, cells in times.items()
        },
    }


# ------------------------------------------------------------------ report
def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# The served path's own cost per iteration\n\n{results['cpu']}, 1 torch thread; "
        f"load average before/after each part in the JSON.\n"
    ]
    if "served" in results:
        lines += [
            "## `dsbd serve`, instant models: router seconds per iteration minus replica "
            "compute (first iteration dropped)\n",
            "| cell | forest | median ms | p90 ms | n | replica compute median ms | "
            "request (wall - compute) / iterations, median ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, c in results["served"]["cells"].items():
            k, r, w = (
                c["calls_per_iteration"],
                c["replica_compute_per_iteration"],
                c["request_wall_minus_compute_per_iteration"],
            )
            lines.append(
                f"| {name} | {c['forest_bytes'] / 1e6:.3f} MB | {k['median_ms']} | "
                f"{k['p90_ms']} | {k['n']} | {r['median_ms']} | {w['median_ms']} |"
            )
    if "mechanisms" in results:
        cells = results["mechanisms"]["cells"]
        methods = list(next(iter(cells.values())))
        lines += [
            "\n## One iteration's calls by mechanism, median (p90) ms\n",
            "| shape | " + " | ".join(methods) + " |",
            "|---|" + "---:|" * len(methods),
        ]
        for shape, by in cells.items():
            lines.append(
                f"| {shape} | "
                + " | ".join(f"{by[m]['median_ms']} ({by[m]['p90_ms']})" for m in methods)
                + " |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["served", "mechanisms", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--port", type=int, default=8771)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next(
        line.split(":", 1)[1].strip()
        for line in lscpu.splitlines()
        if line.startswith("Model name")
    )
    path = OUT.with_suffix(".json")
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results.update({"cpu": f"{cpu}, {os.cpu_count()} cores", "command": " ".join(sys.argv)})
    results["git"] = git_info()  # the commit whose code ran (dirty: which files differ)
    if args.part in ("served", "both"):
        results["served"] = served(args.rounds, args.max_new_tokens, args.port)
    if args.part in ("mechanisms", "both"):
        results["mechanisms"] = mechanisms(args.iterations, args.rounds)
    path.write_text(json.dumps(results, indent=2) + "\n")
    OUT.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
