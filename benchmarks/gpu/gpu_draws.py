"""Does a GPU draw the CPU's numbers and decode the CPU's tokens? (issue 46 item 1, on a device)

    python3 benchmarks/gpu/gpu_draws.py [--device cuda] [--out draws.json]

Every random number of a decode is a hash of its counters (`dsbd_core/algorithm/draws/streams.py`),
so a seeded decode must give the same tokens on every device wherever the log-probs are the
same. This checks it where they are (exact n-gram table scorers, float64, the same table on
both devices): every method and width rule, decoded on the host and on `--device` with the
same seed, with the engine's state beside the table, and once more through the verify side
as one graph (`Decode(graph=True)`: CUDA graphs on a GPU). Also the uniforms themselves,
bitwise, in both dtypes. On a CPU (`--device cpu`) it runs as its own smoke test
(tests/tools/test_gpu_draws.py), the device's branches forced (`computing_everywhere`).
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsbd_core import SamplingConfig, TableScorer
from dsbd_core.algorithm.draws.host_reads import computing_everywhere
from dsbd_core.algorithm.draws.streams import VERIFY_SIDE, Streams
from dsbd_core.algorithm.drivers.loop import Decode, engine_device, run_decode
from dsbd_core.algorithm.methods import method_config

VOCAB, EOS = 16, 0
PROMPTS = [[3, 5, 7], [1, 2], [9, 4, 4, 8]]
CASES: list[tuple[str, dict[str, Any]]] = [  # the first three: tests/tools/test_gpu_draws.py
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
    ("beam", {"width": 3, "selection": "transformers"}),
    ("spec_beam_search", {"width": 3, "gamma": 3}),
    ("sample", {}),
    ("beam", {"width": 3}),
    ("sps", {"gamma": 3}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": None}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": 0.6, "mode": "with_replacement"}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7, "lean_memory": True}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": None, "selection": "transformers"}),
    ("beam_search", {"width": 3}),
]


def random_table(rng: np.random.Generator, vocab: int, order: int) -> np.ndarray:
    """A normalised log-probability table [V] * order with some mass on EOS."""
    weights = rng.dirichlet(np.full(vocab, 0.5), size=vocab ** (order - 1))
    return np.log(weights).reshape((vocab,) * order)


def decode(
    method: str,
    fields: dict[str, Any],
    tables: tuple[np.ndarray, np.ndarray],
    device: str,
    graph: bool = False,
) -> list[list[tuple[list[int], float, bool]]]:
    """Every prompt's beams (tokens, log-likelihood, finished) decoded on `device`."""
    config = SamplingConfig(
        **{"max_new_tokens": 16, "seed": 21, "eos_token_ids": (EOS,), "threshold": None} | fields
    )
    target, draft = (TableScorer(torch.from_numpy(t), device=device) for t in tables)
    run = Decode(
        method_config(method, config), VOCAB, PROMPTS, device=engine_device(target), graph=graph
    )
    results = run_decode(run, target, draft)
    return [[(b.token_ids, b.log_likelihood, b.finished) for b in r.beams] for r in results]


def same(a: list, b: list) -> bool:
    """The same tokens and finish flags, log-likelihoods within float64 rounding."""
    for x, y in zip(a, b, strict=True):
        if [(t, f) for t, _, f in x] != [(t, f) for t, _, f in y]:
            return False
        if any(abs(s - r) > 1e-9 for (_, s, _), (_, r, _) in zip(x, y, strict=True)):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N cases only")
    args = parser.parse_args(argv)
    device = args.device
    on_cpu = torch.device(device).type == "cpu"
    rng = np.random.default_rng(5)
    tables = (random_table(rng, VOCAB, 3), random_table(rng, VOCAB, 3))
    streams = Streams.side(2**45 + 17, 3, VERIFY_SIDE)
    uniforms = {}
    for dtype in (torch.float32, torch.float64):
        host = streams.at(1, 1).uniform((64, 257), dtype, torch.device("cpu"))
        there = streams.on(torch.device(device)).at(1, 1).uniform((64, 257), dtype, device)
        uniforms[str(dtype).removeprefix("torch.")] = bool(torch.equal(there.cpu(), host))
    cases: list[dict[str, Any]] = []
    report: dict[str, Any] = {"all_same": False}
    for method, fields in CASES[: args.cases]:
        host = decode(method, fields, tables, "cpu")
        forced = computing_everywhere() if on_cpu else nullcontext()
        torch._dynamo.reset()  # one config's graphs at a time (Dynamo's recompile limit)
        with forced:
            there = decode(method, fields, tables, device)
            graphed = decode(method, fields, tables, device, graph=True)
        cases.append(
            {
                "method": method,
                "fields": fields,
                "same_tokens": same(host, there),
                "same_tokens_through_verify_graph": same(host, graphed),
            }
        )
        print(method, fields, {k: v for k, v in cases[-1].items() if k.startswith("same")})
        report = {  # written after every case: a run cut short keeps what it checked
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "uniforms_bitwise_equal": uniforms,
            "cases": cases,
            "cases_checked": f"{len(cases)} of {len(CASES)}",
            "all_same": all(uniforms.values())
            and all(c["same_tokens"] and c["same_tokens_through_verify_graph"] for c in cases),
        }
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}))
    return 0 if report["all_same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
