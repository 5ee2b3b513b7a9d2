"""The models' options that config files and flags set, with no torch or transformers import:
a Serve application's builder (deployments/app.py), `dsbd serve`'s config check and the CLI read
them without loading a model. What they mean is done in dsbd_core/models/pair.py (the draft's
int8 and restricted head) and dsbd_core/models/tensor_parallel.py (the group's timeout)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsbd_core.algorithm.scorers.ngram_bounds import (
    LOOKUP_DRAFT,
    NGRAM_DEFAULT,
    NGRAM_MAX,
    NGRAM_MIN,
    ngram_max_problem,
)

# How long a rank waits in a collective of its group. Generous because of loading: ranks that
# load a large model finish minutes apart and must still meet at the barrier after it
# (transformers uses the same 2 h for the groups it creates). A call that hangs is bounded by
# the caller instead (deployments/replicas/tp_group.py breaks the group after its call timeout).
INIT_TIMEOUT_S = 7200.0

# A vocabulary this large gets a restricted draft head by default: its output layer is then a
# large share of a small draft's weights (Qwen2.5: 151936 x 896, 136M of 494M parameters).
LARGE_VOCABULARY = 65536
AUTO_HEAD_TOKENS = 32768


class DraftOptions(BaseModel):
    """How the draft is made cheap (config files, CLI flags). Exact whatever is chosen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantize: Literal["none", "int8", "auto"] = Field(
        "auto",
        description="int8 dynamic quantisation of the draft's linear layers (CPU only). auto: "
        "on a CPU, int8 where a draft step measures faster in int8 than in the model dtype "
        "(measured once per machine and cached); never for float64 models.",
    )
    head_tokens: int | None = Field(
        None,
        ge=0,
        description="Restrict the draft's output layer to this many most frequent tokens "
        f"(FR-Spec; the draft never proposes another token). 0: the full vocabulary. None "
        f"(auto): {AUTO_HEAD_TOKENS} when the vocabulary exceeds {LARGE_VOCABULARY}, else 0.",
    )

    ngram_max: int = Field(
        NGRAM_DEFAULT,
        description=f"The prompt-lookup draft (draft '{LOOKUP_DRAFT}') only: the longest suffix "
        f"it matches in the context ({NGRAM_MIN}..{NGRAM_MAX}).",
    )

    @field_validator("ngram_max", mode="before")
    @classmethod
    def _ngram_range(cls, value: object) -> object:
        problem = ngram_max_problem(value)
        if problem is not None:
            raise ValueError(problem)  # pydantic names the field and the value
        return value

    def head_for(self, vocab_size: int) -> int:
        if self.head_tokens is not None:
            return self.head_tokens
        return AUTO_HEAD_TOKENS if vocab_size > LARGE_VOCABULARY else 0
