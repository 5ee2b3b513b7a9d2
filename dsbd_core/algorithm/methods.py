"""The decoders' methods, and the config each runs with: the one place that decides whether a
decode drafts.

A method name fixes some config fields (`method_config`):
  sample  beam sampling with W = 1 and no draft (= multinomial / ancestral sampling)
  beam    target beam sampling of width W (ALGORITHM.md §1)
  sps     DSBD with W = W_S = 1 and fixed width (= standard speculative sampling)
  dsbd    DSBD as configured (fixed or dynamic width, full or lean memory)
  beam_search       deterministic beam search of width W (= beam with `search`: the W best
                    candidates each step, transformers' num_beams=W, do_sample=False)
  spec_beam_search  speculative beam search (= dsbd with `search`): the draft's beams verified
                    so that the tokens are beam_search's, with fewer target forwards
`config.search` makes any method deterministic (sample: greedy; sps: speculative greedy).

What runs a decode (the engine, the loop, the cost model, the serving router and its
admission) takes a `MethodConfig`, which carries its method, so whether a draft runs is read
from it (`uses_draft`) instead of travelling beside the config as a flag.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from dsbd_core.algorithm.config import SamplingConfig

Method = Literal["dsbd", "beam", "sps", "sample", "beam_search", "spec_beam_search"]
METHODS: tuple[str, ...] = get_args(Method)
METHODS_WITH_DRAFT: tuple[str, ...] = ("sps", "dsbd", "spec_beam_search")
BEAM_METHODS: tuple[str, ...] = ("dsbd", "beam", "beam_search", "spec_beam_search")  # W beams
SEARCH_METHODS: tuple[str, ...] = ("beam_search", "spec_beam_search")  # deterministic search


def drafts(method: str) -> bool:
    """Whether `method` runs a draft model (sps, dsbd, spec_beam_search)."""
    return method in METHODS_WITH_DRAFT


class MethodConfigError(ValueError):
    """A config field the method cannot honour (`field` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class MethodConfig(SamplingConfig):
    """A `SamplingConfig` as one method runs it (built by `method_config`, never by users: the
    flags, HTTP fields and batch rows are `SamplingConfig`'s)."""

    method: Method = Field(description="The decoder that runs this config.")

    @property
    def uses_draft(self) -> bool:
        """The method drafts (sps, dsbd, spec_beam_search): a draft model takes part."""
        return drafts(self.method)

    @property
    def draft_depth(self) -> int:
        """The deepest an iteration drafts: gamma, or 0 for a method without a draft."""
        return self.gamma if self.uses_draft else 0


def method_config(method: str, config: SamplingConfig) -> MethodConfig:
    """The config a method actually runs with.

    selection='transformers' is transformers' beam sampling, `num_beams=W` with W > 1; with
    one beam transformers samples plainly (`_sample`), which is the paper's law at W = 1, so
    one-beam methods run that. The speculative decoders follow the paper's law only.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: allowed methods are {', '.join(METHODS)}")
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
    update: dict = {}
    if method == "sample":
        update = {"width": 1, "w_min": 1, "draft_width": None, "lean_memory": False}
    elif method == "beam":
        update = {"lean_memory": False}
    elif method == "sps":
        update = {"width": 1, "w_min": 1, "draft_width": 1, "threshold": None}
    elif method in ("beam_search", "spec_beam_search"):
        update = {"search": True, "lean_memory": False}
    fields = {name: getattr(config, name) for name in SamplingConfig.model_fields}
    # the config was validated as the user gave it; the method's fields are set as given
    return MethodConfig.model_construct(**{**fields, **update, "method": method})
