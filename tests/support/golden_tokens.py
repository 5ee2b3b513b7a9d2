"""Seeded decodes recorded once, compared forever: a refactor must not move a single draw.

`python -m tests.support.golden_tokens` (from the repository root) writes
`tests/data/golden_tokens.json` with the tokens and scores of every method and decoder path for
fixed seeds, and `tests/algorithm/test_golden_tokens.py` decodes the same cases again and compares.
The file was recorded last when every uniform became a hash of its counters, with no generator
(`streams.py`), and the distinct draw a sequential inverse transform instead of a Gumbel top-k; a
change that moves a draw on purpose records it again, with the exactness tests passing. The models
are built here deterministically: an exact n-gram table and a tiny float64 Llama target/draft pair
with KV caches.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.exact_reference import random_table
from tests.support.tiny_models import tiny_model

PATH = Path(__file__).parents[1] / "data" / "golden_tokens.json"  # tests/data
VOCAB = 24
EOS = 0

# (name, method, config fields): every method and the config corners that change the iteration.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("sample", "sample", {}),
    ("beam-w3", "beam", {"width": 3}),
    ("beam-w3-topk-temp", "beam", {"width": 3, "top_k": 5, "temperature": 0.8}),
    ("sps-g3", "sps", {"gamma": 3}),
    ("dsbd-fixed-w3-g2", "dsbd", {"width": 3, "gamma": 2, "threshold": None}),
    ("dsbd-t0.7-w3-g3", "dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
    ("dsbd-t0.9-ws5", "dsbd", {"width": 3, "draft_width": 5, "gamma": 2, "threshold": 0.9}),
    ("dsbd-lean", "dsbd", {"width": 3, "gamma": 3, "threshold": 0.7, "lean_memory": True}),
    ("dsbd-repl", "dsbd", {"width": 2, "gamma": 2, "threshold": None, "mode": "with_replacement"}),
    ("dsbd-topp", "dsbd", {"width": 3, "gamma": 2, "threshold": 0.6, "top_p": 0.9}),
    ("dsbd-eps", "dsbd", {"width": 3, "gamma": 2, "threshold": None, "epsilon": 0.1}),
]
SEEDS = (0, 1, 2)
PROMPTS = [[3, 5, 7], [1, 2], [9, 4, 4, 8]]


def _table_pair() -> tuple[Any, Any]:
    from dsbd_core import TableScorer

    rng = np.random.default_rng(11)
    target = TableScorer(torch.from_numpy(random_table(rng, VOCAB, 3, concentration=0.5)))
    draft = TableScorer(torch.from_numpy(random_table(rng, VOCAB, 3, concentration=0.5)))
    return target, draft


def _llama_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = tiny_model(VOCAB, seed=5, attn_implementation="sdpa").to(torch.float64)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    draft = tiny_model(VOCAB, attn_implementation="sdpa").to(torch.float64)
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter) * parameter.std())
    return target, draft


def _llama_pair() -> tuple[Any, Any]:
    from dsbd_core.models.transformer_scorer import TransformerScorer

    target, draft = _llama_models()
    return TransformerScorer(target), TransformerScorer(draft)


def _summary(result: Any) -> dict[str, Any]:
    return {
        "beams": [[b.token_ids, round(b.log_likelihood, 9), b.finished] for b in result.beams],
        "stats": {
            k: v
            for k, v in result.stats.as_dict().items()
            if k
            not in (
                "acceptance_rate",
                "target_passes_per_token",
                "mean_accepted_length",
                "epsilon_bias_bound",
            )
        },
    }


def _config(fields: dict[str, Any], seed: int, max_new: int) -> Any:
    from dsbd_core import SamplingConfig

    return SamplingConfig(max_new_tokens=max_new, eos_token_ids=(EOS,), seed=seed, **fields)


def record() -> dict[str, Any]:
    """Every case on both model pairs: one prompt alone, a batch of prompts, and lockstep."""
    from dsbd_core import generate, generate_batch

    out: dict[str, Any] = {}
    pairs: dict[str, Callable[[], tuple[Any, Any]]] = {"table": _table_pair, "llama": _llama_pair}
    for pair_name, make in pairs.items():
        for name, method, fields in CASES:
            for seed in SEEDS:
                target, draft = make()
                config = _config(fields, seed, 12)
                key = f"{pair_name}/{name}/seed{seed}"
                out[key + "/single"] = _summary(generate(method, target, PROMPTS[0], config, draft))
                target, draft = make()
                results = generate_batch(method, target, PROMPTS, config, draft)
                out[key + "/batch"] = [_summary(r) for r in results]
    out.update(record_lockstep())
    return out


def record_lockstep() -> dict[str, Any]:
    """The lockstep batch decoder: every case as one request each, decoded together."""
    from tests.support.golden_paths import lockstep_decode

    out: dict[str, Any] = {}
    requests = []
    for name, method, fields in CASES:
        for seed in SEEDS:
            requests.append(
                (
                    f"llama/{name}/seed{seed}/lockstep",
                    method,
                    _config(fields, seed, 10),
                    PROMPTS[seed % len(PROMPTS)],
                )
            )
    results = lockstep_decode(_llama_models, requests)
    for (key, *_), result in zip(requests, results, strict=True):
        out[key] = _summary(result)
    return out


if __name__ == "__main__":
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(json.dumps(record(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {PATH}")
