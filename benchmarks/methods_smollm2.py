"""Every decoder on the embedded SmolLM2 pair, side by side in one run (README "Measured").

Hardware-independent figures first: target forward passes per emitted token, draft passes,
acceptance, mean accepted length; then wall time per token as a ratio to beam sampling at the
same W (same process, methods interleaved per prompt, so the ratios survive a noisy machine),
and quality as the mean target log-likelihood per token of the returned answer.

    .venv/bin/python benchmarks/methods_smollm2.py [--max-new-tokens 48] [--out FILE]

This is a small precursor of the benchmark harness of a later issue, not a timed test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dsbd_core import SamplingConfig, generate
from dsbd_core.models import encode_prompt, load_causal_lm, stop_token_ids
from dsbd_core.models.transformer_scorer import TransformerScorer

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "Give three tips for learning to cook.",
]

METHODS: dict[str, tuple[str, dict]] = {
    "sample": ("sample", {}),
    "beam W=3": ("beam", {}),
    "sps gamma=3": ("sps", {}),
    "dsbd fixed W=3": ("dsbd", {"threshold": None}),
    "dsbd dynamic t=0.7": ("dsbd", {"threshold": 0.7}),
    "dsbd dynamic t=0.9 w_min=2": ("dsbd", {"threshold": 0.9, "w_min": 2}),
    "dsbd lean t=0.7": ("dsbd", {"threshold": 0.7, "lean_memory": True}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default="smollm2-draft")
    parser.add_argument("--out", default="benchmarks/results/methods_smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = load_causal_lm(args.target), load_causal_lm(args.draft)
    base = SamplingConfig(
        width=3,
        gamma=3,
        max_new_tokens=args.max_new_tokens,
        seed=0,
        eos_token_ids=stop_token_ids(target),
    )
    rows: dict[str, list[dict]] = {name: [] for name in METHODS}
    for prompt in PROMPTS:
        ids = encode_prompt(target, prompt)
        for name, (method, extra) in METHODS.items():
            config = base.model_copy(update=extra)
            start = time.perf_counter()
            result = generate(
                method, TransformerScorer(target.model), ids, config, TransformerScorer(draft.model)
            )
            seconds = time.perf_counter() - start
            st = result.stats
            rows[name].append(
                {
                    "seconds": seconds,
                    "tokens": st.tokens_emitted,
                    "target_passes": st.target_forward_passes,
                    "draft_passes": st.draft_forward_passes,
                    "drafted": st.drafted_tokens,
                    "accepted": st.accepted_tokens,
                    "accepted_layers": st.accepted_layers,
                    "widths": [w for it in st.widths for w in it],
                    "loglik_per_token": result.best.log_likelihood / len(result.best.token_ids),
                    "answer": target.tokenizer.decode(
                        result.best.token_ids, skip_special_tokens=True
                    ),
                }
            )
            print(f"{name:28s} {seconds:6.1f}s  {st.as_dict()['target_passes_per_token']:.3f}")
    beam_spt = sum(r["seconds"] for r in rows["beam W=3"]) / sum(
        r["tokens"] for r in rows["beam W=3"]
    )
    summary = {}
    for name, runs in rows.items():
        tokens = sum(r["tokens"] for r in runs)
        drafted = sum(r["drafted"] for r in runs)
        layers = [a for r in runs for a in r["accepted_layers"]]
        widths = [w for r in runs for w in r["widths"]]
        spt = sum(r["seconds"] for r in runs) / tokens
        summary[name] = {
            "target_passes_per_token": sum(r["target_passes"] for r in runs) / tokens,
            "draft_passes_per_token": sum(r["draft_passes"] for r in runs) / tokens,
            "acceptance_rate": sum(r["accepted"] for r in runs) / drafted if drafted else None,
            "mean_accepted_length": statistics.fmean(layers) if layers else 0.0,
            "mean_width": statistics.fmean(widths) if widths else None,
            "seconds_per_token": spt,
            "time_ratio_to_beam": spt / beam_spt,
            "mean_loglik_per_token": statistics.fmean(r["loglik_per_token"] for r in runs),
            "tokens": tokens,
        }
    out = {
        "what": "every decoder on the embedded SmolLM2 target + first-2-layer draft",
        "config": base.model_dump(mode="json"),
        "prompts": PROMPTS,
        "machine": platform.platform(),
        "threads": 1,
        "summary": summary,
        "runs": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(
        "\n| method | target passes/token | draft passes/token | acceptance | accepted "
        "length | mean width | time/token vs beam | loglik/token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        acc = f"{s['acceptance_rate']:.3f}" if s["acceptance_rate"] is not None else "-"
        width = f"{s['mean_width']:.2f}" if s["mean_width"] is not None else "-"
        print(
            f"| {name} | {s['target_passes_per_token']:.3f} | {s['draft_passes_per_token']:.2f}"
            f" | {acc} | {s['mean_accepted_length']:.2f} | {width} | "
            f"{s['time_ratio_to_beam']:.2f} | {s['mean_loglik_per_token']:.3f} |"
        )


if __name__ == "__main__":
    main()
