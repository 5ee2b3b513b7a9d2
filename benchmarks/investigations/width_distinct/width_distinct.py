"""Dynamic width with distinct drafts: the i.i.d. DP against the estimate of the distinct rule.

`threshold = t` promises that a verified layer passes with probability >= t (ALGORITHM.md §5.2).
With distinct drafts (the default mode) the width used to come from the DP of ALGORITHM.md §5.1,
which assumes i.i.d. drafts; `dsbd_core/algorithm/iteration/width_distinct.py` now estimates the
distinct rule
itself. This script decodes the same prompts with both width rules in one process, alternating which
goes first per prompt, and reports per rule: the realized pass rate of verified layers (against t),
the widths chosen, target and draft forward passes per token, accepted layers per iteration, wall
and CPU time per token, and the target log-likelihood per token of the answer (the quality the
narrower widths may cost). Ratios are "estimate / DP" with paired bootstrap intervals.

    W=benchmarks/investigations/width_distinct
    .venv/bin/python $W/width_distinct.py --pair qwen-coder --prompts 4
    .venv/bin/python $W/width_distinct.py --pair smollm2 --prompts 8

Writes results/width_distinct_<pair>.{json,md} beside this file. Nothing here changes exactness: the
width of a layer depends on neither its drafts nor its uniforms under either rule.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import Counter
from pathlib import Path

import torch

import dsbd_core.algorithm.engine as engine_module
from dsbd.bench.decode.measure import EnergyMeter, measured
from dsbd.bench.decode.methods import parse_methods
from dsbd.bench.decode.quality import answer_log_likelihood, paired_bootstrap, ratio_bootstrap
from dsbd.bench.decode.runners import Pair, run_engine
from dsbd.prompts import PROMPT_SETS, prompt_set
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.iteration.width import layer_width
from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids

PAIRS = {
    "smollm2": ("smollm2", "smollm2-draft", "held-out"),
    "qwen-coder": ("qwen-coder", "qwen-coder-draft", "humaneval"),
}
ESTIMATE = engine_module.distinct_layer_width


def iid_dp_width(target, table, valid_rows, drafts, slots, threshold, w_min, w_max, source):
    """The previous rule: the i.i.d. DP for distinct drafts too (same signature)."""
    restricted = table if valid_rows is None else table * valid_rows
    return layer_width(target, restricted, drafts, slots, threshold, w_min, w_max)


RULES = {"estimate": ESTIMATE, "dp": iid_dp_width}


def decode(rule: str, spec, pair: Pair, ids: list[int], base: SamplingConfig, energy) -> dict:
    engine_module.distinct_layer_width = RULES[rule]
    try:
        pair.reset_counters()
        with measured(pair.device, energy) as cost:
            decoded = run_engine(spec, pair, ids, base)
    finally:
        engine_module.distinct_layer_width = ESTIMATE
    stats = decoded.engine_stats or {}
    widths = [w for it in stats.get("widths", []) for w in it]
    with pair.target_counter.paused():
        loglik = answer_log_likelihood(pair.target.model, ids, decoded.answer_ids)
    return {
        "seconds": cost.seconds,
        "cpu_seconds": cost.cpu_seconds,
        "tokens": decoded.tokens,
        "target_passes": pair.target_counter.calls,
        "draft_passes": pair.draft_counter.calls if pair.draft_counter else 0,
        "accepted_layers": stats.get("accepted_layers", []),
        "widths": widths,
        "answer_tokens": len(decoded.answer_ids),
        "loglik": loglik,
    }


def summary(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    accepted = [a for r in rows for a in r["accepted_layers"]]
    widths = [w for r in rows for w in r["widths"]]
    return {
        "decodes": len(rows),
        "tokens": tokens,
        "pass_rate": sum(accepted) / len(widths) if widths else None,
        "widths": dict(sorted(Counter(widths).items())),
        "mean_width": sum(widths) / len(widths) if widths else None,
        "accepted_layers_per_iteration": sum(accepted) / len(accepted) if accepted else None,
        "target_passes_per_token": sum(r["target_passes"] for r in rows) / tokens,
        "draft_passes_per_token": sum(r["draft_passes"] for r in rows) / tokens,
        "seconds_per_token": sum(r["seconds"] for r in rows) / tokens,
        "cpu_seconds_per_token": sum(r["cpu_seconds"] for r in rows) / tokens,
        "loglik_per_token": sum(r["loglik"] / max(r["answer_tokens"], 1) for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen-coder")
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, help="default: the pair's")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--methods", default="dsbd-w3-t0.7,dsbd-w3-t0.7-lean,dsbd-w4-t0.7")
    parser.add_argument("--gamma", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", help="output stem (default results/width_distinct_<pair> beside this file)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    specs = parse_methods(args.methods, gamma=args.gamma)
    if bad := [s.name for s in specs if s.family != "dsbd" or s.threshold is None]:
        parser.error(f"--methods: {bad} are not dynamic-width DSBD (dsbd-...-t<T>)")
    target_name, draft_name, default_set = PAIRS[args.pair]
    target, draft = load_causal_lm(target_name), load_causal_lm(draft_name)
    pair = Pair(target, draft, torch.device("cpu"), stop_token_ids(target))
    prompts = prompt_set(args.prompt_set or default_set)[: args.prompts]
    energy = EnergyMeter(torch.device("cpu"))
    # Unrecorded warm-up of every method under both rules: a process's first decodes pay for
    # allocations and lazy initialisation, which would land on whichever rule goes first.
    ids = encode_prompt(target, prompts[0].text, chat=prompts[0].chat)
    warm = SamplingConfig(max_new_tokens=4, gamma=args.gamma, seed=0, eos_token_ids=pair.stop_ids)
    for spec in specs:
        for rule in RULES:
            decode(rule, spec, pair, ids, warm, energy)
    records = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(target, prompt.text, chat=prompt.chat)
        base = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            gamma=args.gamma,
            seed=args.seed + i,
            eos_token_ids=pair.stop_ids,
        )
        for spec in specs:
            order = ("estimate", "dp") if i % 2 == 0 else ("dp", "estimate")
            for rule in order:
                row = decode(rule, spec, pair, ids, base, energy)
                records.append({"prompt": prompt.id, "method": spec.name, "rule": rule, **row})
                print(
                    f"{prompt.id:16s} {spec.name:22s} {rule:8s} {row['seconds']:7.1f}s "
                    f"{row['tokens']:3d} tokens {row['target_passes']:3d} target passes",
                    flush=True,
                )
    result: dict = {
        "pair": args.pair,
        "settings": vars(args),
        "command": sys.argv,
        "machine": {
            "platform": platform.platform(),
            "load_average_end": os.getloadavg(),
            "threads": torch.get_num_threads(),
        },
        "methods": {},
        "records": records,
    }
    for spec in specs:
        by = {r: [x for x in records if x["method"] == spec.name and x["rule"] == r] for r in RULES}
        new, old = by["estimate"], by["dp"]
        result["methods"][spec.name] = {
            "threshold": spec.threshold,
            "estimate": summary(new),
            "dp": summary(old),
            "time_estimate_over_dp": ratio_bootstrap(
                [(r["seconds"], r["tokens"]) for r in new],
                [(r["seconds"], r["tokens"]) for r in old],
            ),
            "cpu_estimate_over_dp": ratio_bootstrap(
                [(r["cpu_seconds"], r["tokens"]) for r in new],
                [(r["cpu_seconds"], r["tokens"]) for r in old],
            ),
            "loglik_estimate_minus_dp": paired_bootstrap(
                [
                    a["loglik"] / max(a["answer_tokens"], 1)
                    - b["loglik"] / max(b["answer_tokens"], 1)
                    for a, b in zip(new, old, strict=True)
                ]
            ),
        }
    out = Path(
        args.out or Path(__file__).resolve().parent / "results" / f"width_distinct_{args.pair}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(Path(f"{out}.md").read_text())


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Dynamic width with distinct drafts: estimate vs i.i.d. DP ({result['pair']})",
        "",
        f"{s['prompts']} prompts, {s['max_new_tokens']} new tokens, gamma {s['gamma']}, seed "
        f"{s['seed']} + i, {s['threads']} thread; both rules decode every prompt in one process, "
        f"alternating which goes first; load average at the end "
        f"{tuple(round(x, 2) for x in result['machine']['load_average_end'])}.",
        "",
        "| method | rule | layer pass rate (t) | widths | accepted layers / iteration | "
        "target passes / token | ms / token | estimate / DP time [95% CI] | loglik / token |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in result["methods"].items():
        ratio = m["time_estimate_over_dp"]
        for rule in ("estimate", "dp"):
            x = m[rule]
            shown = f"{ratio['ratio']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}]"
            lines.append(
                f"| {name} | {rule} | {x['pass_rate']:.2f} ({m['threshold']}) | {x['widths']} | "
                f"{x['accepted_layers_per_iteration']:.2f} | {x['target_passes_per_token']:.3f} | "
                f"{1000 * x['seconds_per_token']:.0f} | {shown if rule == 'estimate' else ''} | "
                f"{x['loglik_per_token']:.3f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
