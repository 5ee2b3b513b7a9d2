"""The decoders users call: one interface for sampling, SpS, beam sampling and DSBD.

All four run on `dsbd_core.algorithm.engine.Engine`, driven by the one decode loop
(`dsbd_core.algorithm.loop`); a method name only fixes some config fields:
  sample  beam sampling with W = 1 and no draft (= multinomial / ancestral sampling)
  beam    target beam sampling of width W (ALGORITHM.md §1)
  sps     DSBD with W = W_S = 1 and fixed width (= standard speculative sampling)
  dsbd    DSBD as configured (fixed or dynamic width, full or lean memory)
  beam_search       deterministic beam search of width W (= beam with `search`: the W best
                    candidates each step, transformers' num_beams=W, do_sample=False)
  spec_beam_search  speculative beam search (= dsbd with `search`): the draft's beams verified
                    so that the tokens are beam_search's, with fewer target forwards
`config.search` makes any method deterministic (sample: greedy; sps: speculative greedy).
"""

from __future__ import annotations

from typing import Literal, get_args

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.control import Controller
from dsbd_core.algorithm.loop import Decode, engine_device, run_decode
from dsbd_core.algorithm.result import DecodeResult
from dsbd_core.algorithm.scorer import ForestScorer

Method = Literal["dsbd", "beam", "sps", "sample", "beam_search", "spec_beam_search"]
METHODS: tuple[str, ...] = get_args(Method)
METHODS_WITH_DRAFT: tuple[str, ...] = ("sps", "dsbd", "spec_beam_search")


class MethodConfigError(ValueError):
    """A config field the method cannot honour (`field` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def method_config(method: str, config: SamplingConfig) -> SamplingConfig:
    """The config a method actually runs with.

    selection='transformers' is transformers' beam sampling, `num_beams=W` with W > 1; with
    one beam transformers samples plainly (`_sample`), which is the paper's law at W = 1, so
    one-beam methods run that. The speculative decoders follow the paper's law only.
    """
    if config.selection == "transformers":
        one_beam = method in ("sample", "sps") or config.width == 1
        if one_beam:
            config = config.model_copy(update={"selection": "paper"})
        elif method == "dsbd":  # transformers' law has a fixed width and no lossy mode
            for field, value, neutral in (
                ("threshold", config.threshold, None),
                ("lean_memory", config.lean_memory, False),
                ("epsilon", config.epsilon, 0.0),
            ):
                if value != neutral:
                    raise MethodConfigError(
                        field,
                        f"{field}={value!r} does not apply under selection='transformers' (a"
                        f" fixed width, exact); allowed: {neutral!r}",
                    )
    if method == "sample":
        return config.model_copy(
            update={"width": 1, "w_min": 1, "draft_width": None, "lean_memory": False}
        )
    if method == "beam":
        return config.model_copy(update={"lean_memory": False})
    if method == "sps":
        return config.model_copy(
            update={"width": 1, "w_min": 1, "draft_width": 1, "threshold": None}
        )
    if method == "dsbd":
        return config
    if method in ("beam_search", "spec_beam_search"):
        return config.model_copy(update={"search": True, "lean_memory": False})
    raise ValueError(f"method={method!r}: allowed methods are {', '.join(METHODS)}")


def generate_batch(
    method: str,
    target: ForestScorer,
    prompts: list[list[int]],
    config: SamplingConfig,
    draft: ForestScorer | None = None,
    controller: Controller | None = None,
) -> list[DecodeResult]:
    """Decode several independent prompts in one batched run (one result per prompt).

    `controller` chooses each iteration's speed knobs (default: the config's gamma and W_S).
    """
    run_config = method_config(method, config)
    uses_draft = method in METHODS_WITH_DRAFT
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
        uses_draft=uses_draft,
        controller=controller,
        device=engine_device(target),
    )
    return run_decode(decode, target, draft if uses_draft else None)


def generate(
    method: str,
    target: ForestScorer,
    prompt_ids: list[int],
    config: SamplingConfig,
    draft: ForestScorer | None = None,
    controller: Controller | None = None,
) -> DecodeResult:
    """Decode one prompt: sequences best-first with true log-likelihoods, and stats."""
    return generate_batch(method, target, [list(prompt_ids)], config, draft, controller)[0]
