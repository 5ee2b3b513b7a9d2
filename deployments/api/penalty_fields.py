"""OpenAI's `logit_bias` as the routes take it: a JSON object from token ids (strings, as JSON
keys are) to a bias in [-100, 100], at most 300 entries.

The other processor fields (min_tokens, frequency_penalty, presence_penalty,
repetition_penalty) are `SamplingConfig`'s own and reach the routes through `DecodingKnobs`
with their limits; `logit_bias` alone has another shape on the wire than in the config (a
mapping with string keys, not id pairs), so it is declared here once for the OpenAI routes and
the native route. A key outside the vocabulary is refused by the ingress, which knows the
vocabulary (`Ingress._check_token_fields`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from dsbd_core.algorithm.config import MAX_LOGIT_BIAS


class LogitBiasField(BaseModel):
    """`logit_bias` on the OpenAI and native routes (dsbd_core.algorithm.sequences.penalties)."""

    logit_bias: dict[str, float] | None = Field(
        None,
        description=(
            "OpenAI's field: token id -> bias in [-100, 100] (at most 300), added to the"
            " token's log-weight at every step of every beam, draft and target alike."
        ),
    )

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _ids_and_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"{len(value)} entries; allowed: at most {MAX_LOGIT_BIAS}")
        for key, bias in value.items():
            if not key.strip().isdigit():
                raise ValueError(
                    f"key {key!r} is not a token id; allowed: token ids 0..vocabulary size - 1"
                )
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"[{key!r}]={bias}: allowed: -100 <= bias <= 100")
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """The biases by token id ({} without any)."""
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}
