"""The decoders users call: one interface for sampling, SpS, beam sampling and DSBD.

All run on `dsbd_core.algorithm.engine.Engine`, driven by the one decode loop
(`dsbd_core.algorithm.drivers.loop`); a method name only fixes some config fields
(`dsbd_core.algorithm.methods`: the methods, and the `MethodConfig` each runs with).
"""

from __future__ import annotations

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.drivers.loop import Decode, engine_device, run_decode
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.policy.control import Controller
from dsbd_core.algorithm.scorer import ForestScorer
from dsbd_core.algorithm.sequences.result import DecodeResult
from dsbd_core.algorithm.sequences.stops import StopStrings


def generate_batch(
    method: str,
    target: ForestScorer,
    prompts: list[list[int]],
    config: SamplingConfig,
    draft: ForestScorer | None = None,
    controller: Controller | None = None,
    *,
    stop: StopStrings | None = None,
) -> list[DecodeResult]:
    """Decode several independent prompts in one batched run (one result per prompt).

    `controller` chooses each iteration's speed knobs (default: the config's gamma and W_S);
    `stop`: stop strings, which finish a beam where its text first holds one (`stops.py`).
    """
    run_config = method_config(method, config)
    uses_draft = run_config.uses_draft
    if uses_draft and draft is None:
        raise ValueError(f"method={method!r} needs a draft model; none was given")
    if uses_draft and draft is not None and draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft vocabulary size {draft.vocab_size} != target vocabulary size "
            f"{target.vocab_size}: draft and target must share a vocabulary"
        )
    decode = Decode(
        run_config,
        target.vocab_size,
        [list(p) for p in prompts],
        controller=controller,
        device=engine_device(target),
        stop=stop,
    )
    return run_decode(decode, target, draft if uses_draft else None)


def generate(
    method: str,
    target: ForestScorer,
    prompt_ids: list[int],
    config: SamplingConfig,
    draft: ForestScorer | None = None,
    controller: Controller | None = None,
    *,
    stop: StopStrings | None = None,
) -> DecodeResult:
    """Decode one prompt: sequences best-first with true log-likelihoods, and stats."""
    return generate_batch(method, target, [list(prompt_ids)], config, draft, controller, stop=stop)[
        0
    ]
