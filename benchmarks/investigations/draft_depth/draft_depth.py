"""How deep should a cut draft be? Acceptance and cost of SmolLM2's first-k-layer drafts.

A cut draft (preset `smollm2-draft-<k>`) is the target's first k decoder layers + final norm +
head, untrained. The default `smollm2-draft` is not one of these any more: it is the shipped
`smollm2-distilled`, a 4-layer cut re-trained by `dsbd distill` (docs/DRAFTS.md). For each k
this script measures, on English chat prompts with continuations sampled from the target
(temperature 1) and then teacher-forced through both models:

- acceptance `alpha = mean over positions of sum_x min(p(x), q(x))` (target p, draft q, T = 1):
  the probability that one speculative-sampling draw is accepted (`dsbd.acceptance`, the
  same measure as `dsbd eval-acceptance`);
- decode cost: the median time of one cached forward step (batch 1 and batch 3, the default
  width) relative to the target's, timed interleaved with the target; and the share of the
  target's per-token matrix multiplies (weights touched per token: the head is a fixed cost);
- the standard speculative-sampling speed-up estimate (Leviathan et al. 2023, i.i.d. acceptance)
  `(1 - alpha**(gamma + 1)) / ((1 - alpha) * (gamma * cost + 1))`, at its best gamma in 1..8.

Run: `.venv/bin/python benchmarks/investigations/draft_depth/draft_depth.py` (≈ 2-3 min on 2
CPU cores); writes `results/draft_depth.json` beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dsbd.acceptance import measure_acceptance, next_token_probs, sample_continuations
from dsbd_core.models import encode_prompt, keep_first_layers, load_causal_lm, stop_token_ids

PROMPTS = (
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a cat who learns to swim.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for staying focused while studying.",
    "Describe how a bicycle works to a ten-year-old.",
    "Why do we have seasons on Earth?",
)


def sample_sequences(target, prompts: list[list[int]], new_tokens: int, seed: int):
    """Target-sampled (T = 1) continuations: the text a T = 1 decoder would actually meet."""
    sequences, _ = sample_continuations(
        target.model,
        prompts,
        new_tokens=new_tokens,
        seed=seed,
        stop_ids=stop_token_ids(target),
        pad_id=target.tokenizer.pad_token_id or 0,
    )
    return sequences


class DecodeTimer:
    """Times cached single-token forwards of one model for `batch` rows after a prefix."""

    def __init__(self, model, prefix_len: int, batch: int) -> None:
        self.model, self.batch, self.position = model, batch, prefix_len
        self.cache = DynamicCache()
        with torch.inference_mode():
            model(torch.randint(0, 1000, (batch, prefix_len)), past_key_values=self.cache)

    @torch.inference_mode()
    def step_s(self) -> float:
        token = torch.randint(0, 1000, (self.batch, 1))
        position = torch.full((self.batch, 1), self.position)
        start = time.perf_counter()
        self.model(token, past_key_values=self.cache, position_ids=position, use_cache=True)
        self.position += 1
        return time.perf_counter() - start


def relative_step_cost(draft, target, prefix_len: int, batch: int, steps: int):
    """Median step times (ms) of draft and target, timed interleaved.

    The machine may be shared: timing the two models alternately, step by step, exposes both to
    the same background load, so their ratio is far steadier than two separate runs.
    """
    timers = [DecodeTimer(draft, prefix_len, batch), DecodeTimer(target, prefix_len, batch)]
    for timer in timers:  # warm-up
        timer.step_s()
    times = [[], []]
    for _ in range(steps):
        for timer, bucket in zip(timers, times, strict=True):
            bucket.append(timer.step_s())
    draft_ms, target_ms = (1000 * statistics.median(bucket) for bucket in times)
    return draft_ms, target_ms


def matmul_params(model) -> int:
    """Weights multiplied per token: every parameter except the input embedding lookup
    (the tied head is counted once, as the head)."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight
    return total - embedding.numel() + (head.numel() if head is embedding else 0)


def speedup_estimate(alpha: float, cost: float, max_gamma: int = 8) -> tuple[float, int]:
    """Best expected SpS speed-up over gamma (tokens per iteration / iteration cost)."""
    best = (0.0, 1)
    for gamma in range(1, max_gamma + 1):
        tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1
        best = max(best, (tokens / (gamma * cost + 1), gamma))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 6, 8, 12, 16, 20, 25])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per model")
    parser.add_argument("--threads", type=int, default=1, help="1 = stable timings (see docs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "draft_depth.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_causal_lm("smollm2")
    prompts = [encode_prompt(target, text) for text in PROMPTS]
    sequences = sample_sequences(target, prompts, args.new_tokens, args.seed)
    target_probs = [next_token_probs(target.model, seq) for seq in sequences]
    prefix = max(len(seq.token_ids) for seq in sequences)
    target_macs = matmul_params(target.model)

    rows = []
    for depth in args.depths:
        draft = keep_first_layers(copy.deepcopy(target.model), depth)
        report = measure_acceptance(target.model, draft, sequences, target_probs=target_probs)
        alpha = report.overall.acceptance
        row = {"layers": depth, "acceptance": alpha}
        row["greedy_agreement"] = report.overall.greedy_agreement
        row["matmul_cost"] = matmul_params(draft) / target_macs
        for batch in (1, 3):
            draft_ms, target_ms = relative_step_cost(draft, target.model, prefix, batch, args.steps)
            row[f"draft_step_ms_batch{batch}"] = draft_ms
            row[f"target_step_ms_batch{batch}"] = target_ms
            row[f"relative_cost_batch{batch}"] = draft_ms / target_ms
        speedup, gamma = speedup_estimate(alpha, row["relative_cost_batch1"])
        row["sps_speedup_estimate"], row["best_gamma"] = speedup, gamma
        rows.append(row)
        print(
            f"k={depth:2d}  acceptance={alpha:.3f}  time cost={row['relative_cost_batch1']:.2f}"
            f" (batch 3: {row['relative_cost_batch3']:.2f}, matmuls {row['matmul_cost']:.2f})"
            f"  SpS speed-up estimate {speedup:.2f} at gamma={gamma}"
        )
        del draft

    result = {
        "what": "SmolLM2-135M-Instruct first-k-layer drafts: acceptance sum_x min(p,q) at T=1",
        "prompts": list(PROMPTS),
        "positions": sum(len(p) for p in target_probs),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "seed": args.seed,
        "machine": platform.platform(),
        "torch": torch.__version__,
        "target_params_m": sum(p.numel() for p in target.model.parameters()) / 1e6,
        "drafts": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
