"""The `dsbd bench` tests' quick configuration on the tiny pair (tests/tools/test_bench*.py)."""

from __future__ import annotations

from pathlib import Path

from dsbd.bench.decode.schema import BenchConfig

METHODS = [
    "sample",
    "sps-g2",
    "sps-g2-fk",
    "beam-w2",
    "dsbd-w2-g2-fixed",
    # fixed knobs (-fk): drafting every iteration, which the cost model, starting from this
    # tiny pair's measured pass rates, does not choose (the drafting figures are checked there)
    "dsbd-w2-g2-fixed-fk",
    "dsbd-w2-g2-t0.7-lean",
    "hf-sample",
    "hf-beam-w2",
    "hf-assisted",
]


def bench_config(pair: tuple[Path, Path], **update) -> BenchConfig:
    """A quick float64 run of METHODS on the tiny pair, `update` overriding any field."""
    values = dict(
        pair="custom",
        target=str(pair[0]),
        draft=str(pair[1]),
        mode="quick",
        prompt_set="held-out",
        prompts=2,
        methods=METHODS,
        max_new_tokens=8,
        gamma=2,
        seed=0,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        device="cpu",
        dtype="float64",
        threads=1,
        warmup_tokens=0,
        humaneval_timeout_s=10.0,
        sandbox=None,
    )
    values.update(update)
    return BenchConfig(**values)
