"""The results of side_by_side.py (beside this file): the per-method comparison of the two
sides, the result JSON and the markdown table.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from dsbd.bench.decode.quality import paired_bootstrap, ratio_bootstrap
from dsbd.bench.decode.schema import MethodRecord

# Sibling module: top-level when side_by_side.py runs as a script (this folder is then on
# sys.path), in the `benchmarks` namespace package when imported from the repo root.
try:
    from side_by_side_run import Run
except ModuleNotFoundError:
    from benchmarks.investigations.reference.side_by_side_run import Run


def compare(method: str, records: list[MethodRecord], speculation: dict, budget: int) -> dict:
    """Reference vs ours for one method: per-token rates, quality, paired over prompts."""
    sides = {
        s: {r.prompt_id: r for r in records if r.method == method and r.source == s}
        for s in ("reference", "dsbd")
    }
    prompts = [p for p in sides["dsbd"] if p in sides["reference"]]
    ref = [sides["reference"][p] for p in prompts]
    ours = [sides["dsbd"][p] for p in prompts]
    if not prompts:
        return {"prompts": 0}

    def side(rows: list[MethodRecord], key: str) -> dict:
        tokens = sum(r.tokens for r in rows)
        extra = [speculation.get(key, {}).get(p, {}) for p in prompts]
        accepted = [a for e in extra for a in e.get("accepted_layers", [])]
        widths = [w for e in extra for w in e.get("widths", [])]
        passed = [r.passed for r in rows if r.passed is not None]
        return {
            "tokens": tokens,
            "answer_tokens": sum(r.answer_tokens for r in rows),
            "seconds_per_token": sum(r.seconds for r in rows) / tokens,
            "cpu_seconds_per_token": sum(r.cpu_seconds for r in rows) / tokens,
            "target_passes_per_token": sum(r.target_forward_passes for r in rows) / tokens,
            "draft_passes_per_token": sum(r.draft_forward_passes for r in rows) / tokens,
            "mean_accepted_length": sum(accepted) / len(accepted) if accepted else None,
            "mean_width": sum(widths) / len(widths) if widths else None,
            "target_kv_peak_bytes_max": max(r.target_kv_peak_bytes for r in rows),
            "loglik_per_token": sum(r.loglik / max(r.answer_tokens, 1) for r in rows) / len(rows),
            "pass_at_1": sum(passed) / len(passed) if passed else None,
            "decodes_over_budget": sum(r.tokens > budget for r in rows),
        }

    per_token = [
        (a.loglik / max(a.answer_tokens, 1)) - (b.loglik / max(b.answer_tokens, 1))
        for a, b in zip(ref, ours, strict=True)
    ]
    return {
        "prompts": len(prompts),
        "reference": side(ref, "reference"),
        "ours": side(ours, "dsbd"),
        "time_per_token_reference_over_ours": ratio_bootstrap(
            [(r.seconds, r.tokens) for r in ref], [(r.seconds, r.tokens) for r in ours]
        ),
        "cpu_per_token_reference_over_ours": ratio_bootstrap(
            [(r.cpu_seconds, r.tokens) for r in ref], [(r.cpu_seconds, r.tokens) for r in ours]
        ),
        "loglik_per_token_reference_minus_ours": paired_bootstrap(per_token),
    }


def markdown(result: dict) -> str:
    """The comparison as one markdown table (ratios > 1: the reference is slower)."""
    s = result["settings"]
    lines = [
        f"# Reference (ZongyueQin/DSBD @ {result['reference']['commit'][:10]}) vs ours: "
        f"{result['pair']['name']}",
        "",
        f"target `{result['pair']['target']}`, draft `{result['pair']['draft']}`; "
        f"{s['prompts']} prompts of `{s['prompt_set']}`, max {s['max_new_tokens']} new tokens, "
        f"T = {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, seed {s['seed']} + i; "
        f"1 torch thread each, sides alternating per prompt; {result['created_note']}.",
        "",
        "| method | side | ms/token | ref/ours time [95% CI] | target passes/token | "
        "draft passes/token | accepted length | mean width | loglik/token | pass@1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, c in result["comparison"].items():
        if not c.get("prompts"):
            lines.append(f"| {method} | - | no paired decodes | | | | | | | |")
            continue
        r = c["time_per_token_reference_over_ours"]
        ratio = f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
        for name in ("reference", "ours"):
            x = c[name]
            lines.append(
                f"| {method} | {name} | {1000 * x['seconds_per_token']:.0f} | "
                f"{ratio if name == 'reference' else ''} | {x['target_passes_per_token']:.3f} | "
                f"{x['draft_passes_per_token']:.3f} | {_f(x['mean_accepted_length'], '.2f')} | "
                f"{_f(x['mean_width'], '.2f')} | {x['loglik_per_token']:.3f} | "
                f"{_f(x['pass_at_1'], '.2f')} |"
            )
    q = result["parity"]
    lines += [
        "",
        f"Parity of the reference's model loading with ours (top-20 log-probs at {q['positions']}"
        f" positions): target max |diff| {q['target']['max_abs_logprob_diff_topk']:.1e}, "
        f"draft {q['draft']['max_abs_logprob_diff_topk']:.1e}.",
        "",
    ]
    return "\n".join(lines)


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def build_result(
    run: Run, check: dict, records: list[MethodRecord], errors: list[dict], speculation: dict
) -> dict:
    """The result JSON: settings, versions, parity check, per-method comparison, all records."""
    args, sides, specs = run.args, run.sides, run.specs
    target_name, draft_name = sides.names
    comparison = {
        spec.name: compare(spec.name, records, speculation[spec.name], args.max_new_tokens)
        for spec in specs
    }
    return {
        "pair": {"name": args.pair, "target": target_name, "draft": draft_name},
        "settings": {k: v for k, v in vars(args).items() if k not in ("ref_python", "ref_dir")},
        "command": sys.argv,
        "prompts": [
            {**p.to_dict(), "prompt_ids": ids, "stop_id": stop}
            for p, ids, stop in zip(run.prompts, run.encoded, run.stops, strict=True)
        ],
        "reference": {**sides.hello, "commit": _ref_commit(args.ref_dir)},
        "model_loads": sides.loads,
        "ours_versions": {"torch": torch.__version__, "transformers": _transformers_version()},
        "parity": check,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "load_average_end": list(_load_average()),
            "nice": os.nice(0),
            "threads": torch.get_num_threads(),
        },
        "created_note": f"load average at the end {tuple(round(x, 2) for x in _load_average())}",
        "comparison": comparison,
        "errors": errors,
        "speculation": speculation,
        "records": [r.model_dump() for r in records],
    }


def write_outputs(out: Path, result: dict, records: list[MethodRecord]) -> None:
    """<out>.json, <out>.records.jsonl (the reference's records) and <out>.md; prints the table."""
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(f"{out}.records.jsonl", "w") as stream:
        for record in records:
            if record.source == "reference":
                stream.write(record.model_dump_json() + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(Path(f"{out}.md").read_text())
    print(f"wrote {out}.json, {out}.records.jsonl, {out}.md")


def _load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def _ref_commit(ref_dir: str) -> str:
    done = subprocess.run(
        ["git", "-C", ref_dir, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
