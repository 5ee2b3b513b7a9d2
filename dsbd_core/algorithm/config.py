"""One sampling configuration for every decoder.

Every decoder (multinomial sampling, SpS, beam sampling, DSBD) reads the same fields so that
"DSBD follows beam sampling" is a statement about two runs with the *same* config. Invalid values
are rejected by pydantic; `config_error_message` turns its error into one line per field that
names the field, the value given and what is allowed (used by the CLI and, later, HTTP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

Mode = Literal["with_replacement", "distinct"]
Selection = Literal["paper", "transformers"]
# OpenAI allows at most 300 logit_bias entries
MAX_LOGIT_BIAS = 300


class SamplingConfig(BaseModel):
    """Sampling knobs shared by all decoders.

    Filtering (temperature, top-k, top-p) is applied *jointly* over the table of candidates
    (beams x vocabulary) in beam sampling and in DSBD's target distributions
    (ALGORITHM.md §1, §11.2); with one beam this is ordinary per-token filtering.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0.0, le=100.0, description="Softmax temperature (> 0).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely candidates; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass in (0, 1]; 1 disables.")
    width: int = Field(3, ge=1, le=64, description="Beam width W (target beams per step).")
    draft_width: int | None = Field(
        None, ge=1, le=64, description="Draft beams per draft layer W_S (default: width)."
    )
    gamma: int = Field(3, ge=1, le=32, description="Draft depth: layers drafted per iteration.")
    # Default fixed width: on the Qwen pair (20 HumanEval x 128 tokens, bfloat16) it is the
    # fastest setting measured whose log-likelihood and pass@1 stay within noise of beam
    # sampling; t = 0.7 was faster per iteration but lost ~0.15 log-likelihood per token (W = 4)
    # and 0.66 on the embedded pair (README "Measured", issue 19).
    threshold: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description=(
            "Width threshold t of the dynamic-width rule; None = fixed width W (default: the"
            " output distribution is exactly beam sampling's)."
        ),
    )
    w_min: int = Field(1, ge=1, le=64, description="Smallest width a verified layer may get.")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Tokens to generate at most.")
    eos_token_ids: tuple[int, ...] = Field((), description="Token ids that finish a beam.")
    seed: int | None = Field(None, ge=0, description="Seed of the sampler's random generator.")
    length_penalty: float = Field(
        1.0, ge=0.0, le=10.0, description="Final ranking: log-likelihood / length**penalty."
    )
    mode: Mode = Field(
        "distinct",
        description="with_replacement: W i.i.d. candidates per step; distinct: W distinct ones.",
    )
    lean_memory: bool = Field(
        False,
        description="DSBD keeps one beam (one KV row) between iterations (docs/ALGORITHM.md §7).",
    )
    epsilon: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Over-acceptance epsilon in [0, 1]: accept a draft w.p. min(1, (target + eps) / draft)."
            " 0 = exact (default). eps > 0 trades exactness for speed: fewer rejections, biased"
            " output; the bias bound is reported per request (stats.epsilon_bias_bound)."
        ),
    )
    search: bool = Field(
        False,
        description=(
            "Deterministic beam search (transformers' num_beams=W, do_sample=False): keep the W"
            " highest-scoring candidates each step instead of sampling them; with a draft, the"
            " speculative version (same tokens). temperature, top_k, top_p, threshold, mode,"
            " lean_memory and epsilon do not apply."
        ),
    )
    selection: Selection = Field(
        "paper",
        description=(
            "Which beams beam sampling keeps each step. paper: the W it samples (the DSBD"
            " paper's law, the joint filter over beams x vocabulary). transformers: as"
            " transformers' generate(do_sample=True, num_beams=W): sample K = max(2, 1 + #EOS)"
            " x W distinct candidates, keep the W best by score, finish the EOS ones among"
            " them (temperature, top_k, top_p per beam; length_penalty, early_stopping as in"
            " its beam search). transformers applies to method beam (no draft) only."
        ),
    )
    early_stopping: bool | Literal["never"] = Field(
        False,
        description=(
            "Beam search only, as in transformers: false = stop when no running beam can beat"
            " the worst of the W finished ones at its current length; true = stop once W have"
            " finished; never = assume the best length still to come (max_new_tokens)."
        ),
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description=(
            "Track each generated token's target log-probability (raw model distribution, as"
            " log_likelihood) and its N most likely alternatives, N = this value (0..20);"
            " None: track nothing."
        ),
    )

    # Per-beam processors of the target's (and the draft's) next-token distribution, as
    # OpenAI, vLLM and transformers define them (`penalties.py`, docs/SERVING.md).
    min_tokens: int = Field(
        0,
        ge=0,
        le=32768,
        description=(
            "vLLM's min_tokens: no EOS id (eos_token_ids) and no stop string finishes a beam"
            " before it has generated this many tokens."
        ),
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description=(
            "OpenAI's frequency_penalty in [-2, 2]: subtracted from a token's log-weight once per"
            " time the beam has generated it (generated tokens only)."
        ),
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description=(
            "OpenAI's presence_penalty in [-2, 2]: subtracted from a token's log-weight if the"
            " beam has generated it (generated tokens only)."
        ),
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=100.0,
        description=(
            "transformers' / vLLM's repetition_penalty (> 0, 1 = off): a token seen in the prompt"
            " or the beam has its log-probability multiplied by it where negative, divided where"
            " positive."
        ),
    )
    logit_bias: tuple[tuple[int, float], ...] = Field(
        (),
        max_length=MAX_LOGIT_BIAS,
        description=(
            "OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs, at most 300, added to"
            " those tokens' log-weights (a dict {id: bias} is accepted)."
        ),
    )

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, value: object) -> object:
        """A dict {token id: bias} (OpenAI's form, keys possibly strings) as sorted pairs."""
        if isinstance(value, dict):
            return tuple(sorted((int(k), float(v)) for k, v in value.items()))
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        for token, bias in value:
            if token < 0:
                raise ValueError(f"token id {token} is negative; allowed: ids of the vocabulary")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {token}; allowed: -100 <= bias <= 100")
        if len({token for token, _ in value}) != len(value):
            raise ValueError("a token id appears twice; allowed: one bias per token id")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_budget(self) -> SamplingConfig:
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} is larger than max_new_tokens="
                f"{self.max_new_tokens}; allowed: min_tokens <= max_new_tokens"
            )
        return self

    @property
    def processes_logits(self) -> bool:
        """Whether any per-beam processor is on (`penalties.py`)."""
        return bool(
            self.min_tokens
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @model_validator(mode="after")
    def _selection_samples(self) -> SamplingConfig:
        if self.search and self.selection == "transformers":
            raise ValueError(
                "selection='transformers' samples its candidates, search=true takes the best"
                " ones; allowed: one of them"
            )
        return self

    @model_validator(mode="after")
    def _w_min_within_width(self) -> SamplingConfig:
        if self.w_min > self.width:
            raise ValueError(
                f"w_min={self.w_min} is larger than width={self.width}; "
                "allowed: 1 <= w_min <= width"
            )
        return self

    @property
    def effective_draft_width(self) -> int:
        """The draft width W_S: `draft_width`, or the beam width W when it is not set (the
        field stays None then, so an error can name the field the client actually set)."""
        return self.draft_width if self.draft_width is not None else self.width

    @property
    def searching(self) -> bool:
        """The search engine runs the decode: deterministic beam search, or beam sampling
        under transformers' law (the search's steps with a sampled candidate set)."""
        return self.search or self.selection == "transformers"

    @property
    def fixed_width(self) -> bool:
        """True when every verified layer must keep the full width (no dynamic-width rule)."""
        return self.threshold is None


def error_words(item: Mapping[str, Any]) -> str:
    """A pydantic error's message without the "Value error, " it puts before a validator's
    own words (every error dsbd shows, CLI or HTTP, words them the same)."""
    return str(item.get("msg", "invalid")).removeprefix("Value error, ")


def config_error_message(error: ValidationError) -> str:
    """One line per invalid field: `field=value: what is allowed`."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        value = item.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{field}{shown}: {error_words(item)}")
    return "\n".join(lines)


def first_error(error: ValidationError, prefix: str) -> str:
    """The first invalid field of `error` as `prefix.field=value: what is allowed`: a nested
    config's error named from its parent's field (a Serve option, a request default)."""
    first = error.errors()[0]
    where = ".".join([prefix, *(str(part) for part in first["loc"])])
    return f"{where}={first.get('input')!r}: {error_words(first)}"
