"""The methods a benchmark run compares, named by a small grammar so `--methods` can ask for any.

    sample                       multinomial sampling (our engine; = beam sampling with W = 1)
    sps-g{G}                     speculative sampling, draft depth G
    beam-w{W}                    beam sampling of width W (our engine)
    beam-w{W}-tf                 beam sampling of width W under transformers' law (our engine,
                                 selection='transformers': K = 2W sampled, the W best kept)
    dsbd-w{W}-g{G}-fixed         DSBD, fixed width W
    dsbd-w{W}-g{G}-t{T}          DSBD, dynamic width with threshold T (w_min 1)
    ...-ws{S}                    draft width W_S = S (default: W)
    ...-wmin{M}                  smallest width M (dynamic width only)
    ...-lean                     memory-lean DSBD (one beam between iterations, ALGORITHM.md §7)
    ...-fk                       fixed knobs: draft exactly G layers every iteration (default:
                                 the cost model chooses the depth per iteration, up to G)
    ...-ng                       the prompt-lookup draft (`--draft ngram`, the run's
                                 --ngram-max) instead of the draft model (sps, dsbd,
                                 spec-search)
    dsbd-w{W}-g{G}-fixed-tf      DSBD under transformers' law (selection='transformers')
    hf-sample                    transformers `generate(do_sample=True)`
    hf-beam-w{W}                 transformers `generate(num_beams=W, do_sample=True)`
    hf-assisted                  transformers `generate(assistant_model=draft, do_sample=True)`
    hf-lookup[-g{G}]             transformers `generate(prompt_lookup_num_tokens=G,
                                 max_matching_ngram_size=--ngram-max, do_sample=True)`
    search-w{W}                  deterministic beam search of width W (our engine, beam_search)
    spec-search-w{W}-g{G}        speculative beam search (spec_beam_search): the same tokens as
                                 search-w{W}; takes -ws{S} and -fk like dsbd
    hf-search-w{W}               transformers `generate(num_beams=W, do_sample=False)`

`g{G}` may be left out (the run's `--gamma` applies); names are canonicalised (gamma always
written, `t0.90` -> `t0.9`) so the same method has one name in every result file.
Every method has a width W; its *reference* is our beam sampling at the same W (`sample` for
W = 1), which is what time ratios and quality differences are taken against; for the search
families it is our plain beam search at the same W (`search-w{W}`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dsbd_core.algorithm.config import SamplingConfig

Family = Literal[
    "sample",
    "sps",
    "beam",
    "dsbd",
    "hf-sample",
    "hf-beam",
    "hf-assisted",
    "hf-lookup",
    "search",
    "spec-search",
    "hf-search",
]
ENGINE_FAMILIES = ("sample", "sps", "beam", "dsbd", "search", "spec-search")
DRAFT_FAMILIES = ("sps", "dsbd", "hf-assisted", "spec-search")
SEARCH_FAMILIES = ("search", "spec-search", "hf-search")
# our decoders' names (dsbd_core.algorithm.drivers.decoders) where they differ from the family's
_ENGINE_METHOD = {"search": "beam_search", "spec-search": "spec_beam_search"}
GRAMMAR = (
    "sample | sps[-g<G>][-fk][-ng] | beam-w<W>[-tf] | "
    "dsbd-w<W>[-g<G>](-fixed|-t<T>)[-ws<S>][-wmin<M>][-lean][-fk][-tf][-ng] | "
    "hf-sample | hf-beam-w<W> | hf-assisted | hf-lookup[-g<G>] | "
    "search-w<W> | spec-search-w<W>[-g<G>][-ws<S>][-fk][-ng] | hf-search-w<W>"
)
LOOKUP_FAMILIES = ("sps", "dsbd", "spec-search")  # take -ng: the prompt-lookup draft


class MethodNameError(ValueError):
    """A `--methods` entry that does not follow the grammar."""


@dataclass(frozen=True)
class MethodSpec:
    """One method of a run: which decoder, with which width/depth/threshold."""

    family: Family
    width: int = 1
    gamma: int | None = None  # draft depth (sps, dsbd); None for methods without a draft
    threshold: float | None = None  # dsbd dynamic width; None = fixed width
    w_min: int = 1
    lean: bool = False
    draft_width: int | None = None  # W_S; None = W
    fixed_knobs: bool = False  # draft gamma layers every iteration (no cost model)
    transformers_law: bool = False  # selection='transformers' (beam only)
    lookup: bool = False  # the prompt-lookup draft instead of the draft model (-ng)

    @property
    def name(self) -> str:
        """Canonical name (the key of every result record)."""
        return self._name() + ("-ng" if self.lookup else "")

    def _name(self) -> str:
        if self.family in ("sample", "hf-sample", "hf-assisted"):
            return self.family
        if self.family == "hf-lookup":
            return f"hf-lookup-g{self.gamma}"
        if self.family == "sps":
            return f"sps-g{self.gamma}" + ("-fk" if self.fixed_knobs else "")
        if self.family in ("beam", "hf-beam", "search", "hf-search"):
            return f"{self.family}-w{self.width}" + ("-tf" if self.transformers_law else "")
        if self.family == "spec-search":
            ws = f"-ws{self.draft_width}" if self.draft_width not in (None, self.width) else ""
            return f"spec-search-w{self.width}-g{self.gamma}{ws}" + ("-fk" * self.fixed_knobs)
        parts = [f"dsbd-w{self.width}", f"g{self.gamma}"]
        parts.append("fixed" if self.threshold is None else f"t{self.threshold:g}")
        if self.draft_width is not None and self.draft_width != self.width:
            parts.append(f"ws{self.draft_width}")
        if self.w_min != 1:
            parts.append(f"wmin{self.w_min}")
        if self.lean:
            parts.append("lean")
        if self.fixed_knobs:
            parts.append("fk")
        if self.transformers_law:
            parts.append("tf")
        return "-".join(parts)

    @property
    def engine(self) -> bool:
        """True for our engine's decoders, False for transformers' `generate`."""
        return self.family in ENGINE_FAMILIES

    @property
    def uses_draft(self) -> bool:
        """A draft takes part: the draft model, or the prompt lookup (-ng)."""
        return self.family in DRAFT_FAMILIES

    @property
    def uses_draft_model(self) -> bool:
        """The run's draft model takes part (not with -ng)."""
        return self.uses_draft and not self.lookup

    @property
    def reference(self) -> str:
        """The method time ratios and quality differences are taken against."""
        if self.family in SEARCH_FAMILIES:
            return f"search-w{self.width}"
        return "sample" if self.width == 1 else f"beam-w{self.width}"

    def engine_method(self) -> str:
        """The `dsbd_core.algorithm.drivers.decoders` method name."""
        if not self.engine:
            raise ValueError(f"{self.name} is not an engine method")
        return _ENGINE_METHOD.get(self.family, self.family)

    def sampling_config(self, base: SamplingConfig) -> SamplingConfig:
        """`base` with this method's width, depth, threshold, w_min and lean flag."""
        update: dict[str, object] = {"width": self.width, "w_min": self.w_min}
        if self.gamma is not None:
            update["gamma"] = self.gamma
        if self.family == "dsbd":
            update.update(
                threshold=self.threshold, lean_memory=self.lean, draft_width=self.draft_width
            )
        if self.family == "spec-search":
            update["draft_width"] = self.draft_width
        if self.transformers_law:
            update["selection"] = "transformers"
        return SamplingConfig(**{**base.model_dump(), **update})  # validated (model_copy is not)


_OPTION = re.compile(r"^(w|g|t|ws|wmin)(\d+(?:\.\d+)?)$")


def parse_method(text: str, *, gamma: int) -> MethodSpec:
    """Parse one method name; `gamma` fills in a left-out `g<G>`."""
    name = text.strip()
    families: tuple[Family, ...] = (
        "hf-sample",
        "hf-assisted",
        "hf-lookup",
        "hf-beam",
        "hf-search",
        "spec-search",
        "search",
        "sample",
        "sps",
        "beam",
        "dsbd",
    )
    for family in families:
        if name == family or name.startswith(family + "-"):
            rest = name[len(family) + 1 :].split("-") if name != family else []
            return _build(family, rest, gamma, text)
    raise MethodNameError(f"method={text!r}: unknown method; allowed: {GRAMMAR}")


def _build(family: Family, rest: list[str], gamma: int, text: str) -> MethodSpec:
    values: dict[str, float] = {}
    flags = set()
    for part in rest:
        match = _OPTION.match(part)
        if match:
            values[match.group(1)] = float(match.group(2))
        elif part in ("fixed", "lean", "fk", "tf", "ng"):
            flags.add(part)
        else:
            raise MethodNameError(f"method={text!r}: unknown part {part!r}; allowed: {GRAMMAR}")
    allowed = {
        "sample": set(),
        "hf-sample": set(),
        "hf-assisted": set(),
        "hf-lookup": {"g"},
        "sps": {"g"},
        "beam": {"w"},
        "hf-beam": {"w"},
        "dsbd": {"w", "g", "t", "ws", "wmin"},
        "search": {"w"},
        "hf-search": {"w"},
        "spec-search": {"w", "g", "ws"},
    }[family]
    extra = set(values) - allowed
    fk_ok = ("sps", "dsbd", "spec-search")
    own = {"dsbd": {"fixed", "lean", "fk", "tf"}, "beam": {"tf"}}.get(family, set()) | (
        {"fk"} if family in fk_ok else set()
    )
    own |= {"ng"} if family in LOOKUP_FAMILIES else set()
    if extra or flags - own:
        bad = sorted(extra) or sorted(flags - own)
        raise MethodNameError(f"method={text!r}: {family} takes no {bad}; allowed: {GRAMMAR}")
    if family in ("beam", "hf-beam", "dsbd", *SEARCH_FAMILIES) and "w" not in values:
        raise MethodNameError(f"method={text!r}: {family} needs a width w<W>; allowed: {GRAMMAR}")
    if family == "dsbd" and ("t" in values) == ("fixed" in flags):
        raise MethodNameError(f"method={text!r}: dsbd needs exactly one of -fixed or -t<T>")
    width = int(values.get("w", 1))
    spec = MethodSpec(
        family=family,
        width=width,
        gamma=int(values.get("g", gamma))
        if family in ("sps", "dsbd", "spec-search", "hf-lookup")
        else None,
        threshold=values.get("t"),
        w_min=int(values.get("wmin", 1)),
        lean="lean" in flags,
        draft_width=int(values["ws"]) if "ws" in values else None,
        fixed_knobs="fk" in flags,
        transformers_law="tf" in flags,
        lookup="ng" in flags,
    )
    try:  # the config model validates ranges (width 1..64, 0 <= t <= 1, w_min <= width, ...)
        spec.sampling_config(SamplingConfig())
    except ValueError as error:
        raise MethodNameError(f"method={text!r}: {error}") from None
    return spec


def parse_methods(text: str, *, gamma: int) -> list[MethodSpec]:
    """Comma-separated method names -> specs (duplicates after canonicalisation dropped)."""
    specs: dict[str, MethodSpec] = {}
    for part in text.split(","):
        if part.strip():
            spec = parse_method(part, gamma=gamma)
            specs.setdefault(spec.name, spec)
    if not specs:
        raise MethodNameError(f"methods={text!r}: no method given; allowed: {GRAMMAR}")
    return list(specs.values())


def with_references(specs: list[MethodSpec]) -> list[MethodSpec]:
    """Add the reference (beam sampling at the same W) of every method that lacks one."""
    names = {s.name for s in specs}
    out = list(specs)
    for spec in specs:
        if spec.reference not in names:
            reference = parse_method(spec.reference, gamma=1)
            out.insert(0, reference)
            names.add(reference.name)
    return out


# Default method sets (names; `g` comes from --gamma). Quick = the list at W = 3 plus the
# transformers baselines; full adds W = 2 and 4 and more dynamic-width settings.
QUICK_METHODS = (
    "sample",
    "sps",
    "beam-w2",
    "beam-w3",
    "beam-w4",
    "dsbd-w3-fixed",
    "dsbd-w3-t0.7",
    "dsbd-w3-t0.9",
    "dsbd-w3-t0.9-wmin2",
    "dsbd-w3-t0.7-lean",
    "hf-sample",
    "hf-beam-w3",
    "hf-assisted",
)
FULL_METHODS = (
    "sample",
    "sps-g1",
    "sps",
    "beam-w2",
    "beam-w3",
    "beam-w4",
    "dsbd-w3-fixed",
    "dsbd-w4-fixed",
    "dsbd-w3-g1-t0.7",
    "dsbd-w3-t0.7",
    "dsbd-w3-t0.9-wmin2",
    "dsbd-w4-t0.7",
    "dsbd-w4-t0.9-wmin2",
    "dsbd-w3-t0.7-lean",
    "hf-sample",
    "hf-beam-w3",
    "hf-assisted",
)
