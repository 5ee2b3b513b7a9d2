"""Does the cost model price an iteration as it costs on this machine?

The cost model (dsbd_core/algorithm/policy/cost_model.py) picks each iteration's draft depth
gamma by expected tokens per predicted second, the seconds being `CostController.iteration_seconds`:
the target's forward over W + gamma x W_S tokens, the draft's passes and the engine's work, from
this machine's calibration, scaled at each depth to the whole iterations the calibration timed
(on other prompts, 16 tokens each). This script decodes the same prompts with DSBD at every depth
0..G held fixed for the whole decode (fixed knobs), depths interleaved per prompt, and prints
per depth the measured seconds per iteration, the predicted ones and their ratio, with the
pass rates measured on the way and the tokens per second each depth really gave. A depth whose
measured/predicted ratio exceeds depth 0's is under-priced: the cost model drafts it where it
does not pay. The prompts are not the calibration's, so the check also says what the
calibration predicts of them before any evidence of their own: tokens per iteration from the
calibration's pass rates, tokens per second, and the depth it would choose, beside what each
depth measured (`--report JSON` prints this again from a saved run).

    .venv/bin/python benchmarks/cost_model_check.py --pair qwen-coder --prompt-set held-out \\
        --prompts 4 --max-new-tokens 32 --json benchmarks/results/cost_model_check_qwen.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from dsbd.bench.decode.pairs import PAIRS
from dsbd.prompts import prompt_set
from dsbd_core import SamplingConfig, generate
from dsbd_core.algorithm.policy.control import FixedKnobs, Knobs
from dsbd_core.algorithm.policy.cost_model import Calibration, CostController, expected_tokens
from dsbd_core.algorithm.sequences.state import DecodeState
from dsbd_core.models.calibrate import PassCounter
from dsbd_core.models.pair import load_pair


class _DepthZero(FixedKnobs):
    """Depth 0 every iteration: DSBD that never drafts."""

    def knobs(self, state: DecodeState) -> Knobs:
        return Knobs(gamma=0, draft_width=self._knobs.draft_width)


def held_out_prediction(run: dict) -> dict:
    """What the calibration's pass rates predict of these prompts at each depth (tokens per
    iteration and per second, at the predicted seconds) against what each depth measured, and
    the depth each says is fastest: the cost model's choice before a request's own evidence."""
    rates = run["calibration_pass_rates"]
    rows = []
    for row in run["depths"]:
        gamma = 0 if row["gamma"] == "dsbd at 0" else int(row["gamma"])
        predicted = expected_tokens(rates, gamma)
        rows.append(
            {
                "gamma": row["gamma"],
                "tokens_per_iteration": {
                    "predicted": predicted,
                    "measured": row["tokens_per_s"] * row["measured_s"],
                },
                "tokens_per_s": {
                    "predicted": predicted / row["predicted_s"],
                    "measured": row["tokens_per_s"],
                },
            }
        )
    ranked = [r for r in rows if r["gamma"] != "dsbd at 0"]
    best = {
        side: max(ranked, key=lambda r: r["tokens_per_s"][side])["gamma"]
        for side in ("predicted", "measured")
    }
    return {"depths": rows, "fastest_depth": best}


def print_prediction(prediction: dict) -> None:
    for row in prediction["depths"]:
        name = "dsbd at 0" if row["gamma"] == "dsbd at 0" else f"gamma {row['gamma']}"
        per_iteration, per_second = row["tokens_per_iteration"], row["tokens_per_s"]
        print(
            f"{name:9}: tokens/iteration {per_iteration['predicted']:.2f} predicted, "
            f"{per_iteration['measured']:.2f} measured; tokens/s {per_second['predicted']:.2f} "
            f"predicted, {per_second['measured']:.2f} measured"
        )
    best = prediction["fastest_depth"]
    print(f"fastest depth: predicted {best['predicted']}, measured {best['measured']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="print a saved run's held-out prediction")
    parser.add_argument("--pair", default="smollm2", choices=sorted(PAIRS))
    parser.add_argument("--prompt-set", default="held-out")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--max-gamma", type=int, default=3)
    parser.add_argument("--selection", default="paper", choices=["paper", "transformers"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.report:
        print_prediction(held_out_prediction(json.loads(args.report.read_text())))
        return 0
    torch.set_num_threads(1)
    preset = PAIRS[args.pair]
    pair = load_pair(preset.target, preset.draft)
    calibration = pair.calibration(say=print)
    target, draft = pair.scorers()
    prompts = prompt_set(args.prompt_set)[: args.prompts]
    encoded = [pair.encode(p.text, chat=p.chat) for p in prompts]
    # -1: DSBD with a depth of 0 every iteration (what the cost model's "0" runs), beside 0:
    # plain beam sampling (what it is priced as)
    depths = range(-1, args.max_gamma + 1)
    seconds = {g: 0.0 for g in depths}
    iterations = {g: 0 for g in depths}
    tokens = {g: 0 for g in depths}
    passes: dict[int, list[list[float]]] = {}
    load = [os.getloadavg()]
    # warm-up (not timed): the first decode of a process pays one-time costs (kernel choice,
    # allocations) that would otherwise land on whichever depth runs first
    for index, prompt_ids in [(-1, encoded[0])] + list(enumerate(encoded)):
        for g in depths:  # interleaved per prompt
            config = SamplingConfig(
                width=args.width,
                gamma=max(g, 1),  # depth 0 is plain beam sampling (its config's gamma unused)
                max_new_tokens=args.max_new_tokens,
                seed=max(index, 0),
                eos_token_ids=pair.stop_ids,
                selection=args.selection,
            )
            controller = None if g == 0 else _DepthZero(config) if g < 0 else PassCounter(config)
            start = time.perf_counter()
            method, side = ("dsbd", draft) if g else ("beam", None)
            result = generate(method, target, prompt_ids, config, draft=side, controller=controller)
            if index < 0:
                continue
            seconds[g] += time.perf_counter() - start
            iterations[g] += result.stats.iterations
            tokens[g] += result.stats.tokens_emitted
            if isinstance(controller, PassCounter):
                for k, (passed, tried) in enumerate(controller.counts):
                    total = passes.setdefault(g, [[0.0, 0.0] for _ in range(g)])[k]
                    total[0] += passed
                    total[1] += tried
    load.append(os.getloadavg())
    config = SamplingConfig(width=args.width, gamma=args.max_gamma, eos_token_ids=pair.stop_ids)
    model = CostController(config, calibration)
    rows = []
    for g in depths:
        measured = seconds[g] / max(iterations[g], 1)
        predicted = model.iteration_seconds(max(g, 0))
        rates = [p / t for p, t in passes.get(g, []) if t > 0]
        rows.append(
            {
                "gamma": "dsbd at 0" if g < 0 else g,
                "measured_s": measured,
                "predicted_s": predicted,
                "ratio": measured / predicted,
                "tokens_per_s": tokens[g] / seconds[g],
                "pass_rates": rates,
            }
        )
        name = "dsbd at 0" if g < 0 else f"gamma {g}"
        print(
            f"{name:9}: {measured * 1e3:7.1f} ms/iteration measured, {predicted * 1e3:7.1f} "
            f"predicted (x{measured / predicted:.2f}); {tokens[g] / seconds[g]:.2f} tokens/s; "
            f"pass rates {', '.join(f'{r:.2f}' for r in rates) or '-'}"
        )
    print(
        f"calibrated pass rates: {calibration.pass_rates}; catch-up per step behind: "
        f"{calibration.catch_up_s}; load average {load}"
    )
    if args.json:
        _write(args, pair.describe(), calibration, load, rows)
    return 0


def _write(
    args: argparse.Namespace, models: str, calibration: Calibration, load: list, rows: list
) -> None:
    """The run's JSON, with what the calibration predicted of these prompts."""
    out = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpu": platform.processor() or platform.machine(),
        "models": models,
        "calibration_pass_rates": calibration.pass_rates,
        "calibration_iteration_s": calibration.iteration_s,
        "calibration_catch_up_s": calibration.catch_up_s,
        "load_average": load,
        "depths": rows,
    }
    out["held_out_prediction"] = held_out_prediction(out)
    print_prediction(out["held_out_prediction"])
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
