"""Where a decode's time goes: target forwards, draft forwards, and the engine's own work.

    .venv/bin/python benchmarks/profile_decode.py --pair qwen-coder \\
        --methods beam-w4,dsbd-w4-g3-t0.7 --prompts 2 --max-new-tokens 64 [--cprofile 25]

Each method decodes the same HumanEval (qwen-coder) or held-out (smollm2) prompts, methods
interleaved per prompt, in one process with one torch thread. Every model forward is timed by
wrapping the model's `forward`; what is left of the decode's wall time is the engine: sampling,
verification, width rules, cache compaction, bookkeeping. The issue's target (issue 19, item 3)
is that the engine stays within 10 % of DSBD's decode time on the Qwen pair at W = 4, gamma = 3.
`--cprofile N` prints the N functions with the most own time for each method (the first prompt),
which is where to look next.

Run it on a quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from dataclasses import asdict, dataclass, field

import torch

from dsbd.bench.decode.methods import parse_methods
from dsbd.bench.decode.pairs import PAIRS
from dsbd.prompts import prompt_set
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.models.options import DraftOptions
from dsbd_core.models.pair import load_pair
from dsbd_core.models.transformer_scorer import TransformerScorer


@dataclass
class ForwardTimer:
    """Wraps a model's `forward` and adds up its wall time and calls."""

    model: torch.nn.Module
    seconds: float = 0.0
    calls: int = 0
    _original: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._original = self.model.forward

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._original(*args, **kwargs)  # type: ignore[operator]
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        self.model.forward = timed  # type: ignore[method-assign]

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


@dataclass
class Split:
    """One method's time split over the prompts."""

    method: str
    tokens: int = 0
    seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_calls: int = 0
    draft_calls: int = 0
    iterations: int = 0

    @property
    def engine_seconds(self) -> float:
        return self.seconds - self.target_seconds - self.draft_seconds

    def row(self) -> str:
        per = 1000 / max(self.tokens, 1)
        share = self.engine_seconds / self.seconds if self.seconds else 0.0
        return (
            f"| {self.method} | {self.tokens} | {self.seconds * per:.1f} | "
            f"{self.target_seconds * per:.1f} | {self.draft_seconds * per:.1f} | "
            f"{self.engine_seconds * per:.1f} | {100 * share:.1f} % | "
            f"{self.iterations} | {self.tokens / max(self.iterations, 1):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen-coder")
    parser.add_argument("--methods", default="beam-w4,dsbd-w4-g3-t0.7")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-quantize", default="auto", choices=("none", "int8", "auto"))
    parser.add_argument(
        "--draft-head-tokens",
        type=int,
        default=0,
        help="restrict the draft head to K frequent tokens (0: full head)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--json", help="also write the splits here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = PAIRS[args.pair]
    print(f"load average before: {os.getloadavg()}")
    options = DraftOptions(quantize=args.draft_quantize, head_tokens=args.draft_head_tokens)
    pair = load_pair(preset.target, preset.draft, dtype=args.dtype, draft_options=options)
    print(pair.describe())
    target_timer, draft_timer = ForwardTimer(pair.target.model), ForwardTimer(pair.draft.model)
    specs = parse_methods(args.methods, gamma=preset.gamma)
    splits = {spec.name: Split(spec.name) for spec in specs}
    prompts = prompt_set(preset.prompt_set)[: args.prompts]
    for index, prompt in enumerate(prompts):
        ids = pair.encode(prompt.text, chat=prompt.chat)
        for spec in specs:
            config = spec.sampling_config(pair.sampling_config(args.max_new_tokens, args.seed))
            draft = TransformerScorer(pair.draft.model) if spec.uses_draft else None
            profiler = cProfile.Profile() if args.cprofile and index == 0 else None
            target_timer.take(), draft_timer.take()
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            result = generate(
                spec.engine_method(), TransformerScorer(pair.target.model), ids, config, draft
            )
            if profiler is not None:
                profiler.disable()
            split = splits[spec.name]
            split.seconds += time.perf_counter() - start
            seconds, calls = target_timer.take()
            split.target_seconds += seconds
            split.target_calls += calls
            seconds, calls = draft_timer.take()
            split.draft_seconds += seconds
            split.draft_calls += calls
            split.tokens += result.stats.tokens_emitted
            split.iterations += result.stats.iterations
            if profiler is not None:
                _print_profile(spec.name, profiler, args.cprofile)
    print(f"load average after: {os.getloadavg()}")
    print(
        "\n| method | tokens | ms/token | target ms/token | draft ms/token | engine ms/token "
        "| engine share | iterations | tokens/iteration |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for split in splits.values():
        print(split.row())
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                [asdict(s) | {"engine_seconds": s.engine_seconds} for s in splits.values()],
                out,
                indent=1,
            )


def _print_profile(name: str, profiler: cProfile.Profile, top: int) -> None:
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer).sort_stats("tottime")
    stats.print_stats(top)
    print(f"\n--- cProfile {name} (own time, top {top})")
    print("\n".join(line for line in buffer.getvalue().splitlines()[: top + 12] if line.strip()))


if __name__ == "__main__":
    main()
