"""The request fields that say where a beam stops, shared by the OpenAI routes, the native
route and (`StopFields` only) `dsbd batch` rows: stop strings matched on the text, and vLLM's
`stop_token_ids` and `ignore_eos`, which change the set of tokens that finish a beam.

Each is the EOS rule with another set or on the text (dsbd_core/algorithm/sequences/stops.py), so
every method's law stays exact; bad values are refused naming the field, the value and what is
allowed (HTTP 400, or a batch row's error).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from dsbd_core.algorithm.sequences.stop_text import MAX_STOPS, stop_problem


class StopFields(BaseModel):
    """Stop strings as OpenAI and vLLM take them: the OpenAI routes, the native route and
    `dsbd batch` rows share the fields, their limits and their error messages."""

    stop: str | list[str] | None = Field(
        None,
        description=(
            "Stop strings, matched on the generated text (any length): a beam finishes where"
            " its text first holds one, as at an EOS token, and its text ends before it."
        ),
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM's field: the returned text keeps the stop string it ends with."
    )

    @field_validator("stop", mode="after")
    @classmethod
    def _stops_within_limits(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None:
            problem = stop_problem([value] if isinstance(value, str) else value)
            if problem is not None:
                raise ValueError(problem)
        return value

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (none: [])."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class EosFields(BaseModel):
    """vLLM's fields that change which tokens finish a beam, on the OpenAI and native routes:
    a beam still finishes at a token of the set, so every method's law stays exact (the EOS
    rule with another set)."""

    stop_token_ids: list[int] | None = Field(
        None,
        max_length=MAX_STOPS,
        description=(
            "vLLM's field: token ids that finish a beam as an EOS token does, besides the"
            " model's (each 0..vocabulary size - 1); `stop_reason` names the id."
        ),
    )
    ignore_eos: bool = Field(
        False,
        description=(
            "vLLM's field: the model's EOS tokens do not finish a beam (stop strings and"
            " stop_token_ids still do)."
        ),
    )

    @field_validator("stop_token_ids", mode="after")
    @classmethod
    def _ids_not_negative(cls, value: list[int] | None) -> list[int] | None:
        for i, token in enumerate(value or ()):
            if token < 0:
                raise ValueError(
                    f"stop_token_ids[{i}]={token} is negative; allowed: token ids 0..vocabulary"
                    " size - 1"
                )
        return value

    def eos_ids(self, model_eos: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that finish a beam for this request: the model's (none with `ignore_eos`),
        then `stop_token_ids`, each once."""
        base = () if self.ignore_eos else tuple(model_eos)
        return tuple(dict.fromkeys(base + tuple(self.stop_token_ids or ())))
