"""`dsbd batch` rows: the per-row request model, row ids and content hashes.

The actors receive one string column per row, `row` (the row as JSON text: a JSONL line as
it is, a Parquet row dumped), next to its `index`, `id`, `row_hash` and `problem`
(`ROWS_SCHEMA`; deployments/batch_job/inputs.py reads the files, deployments/batch_job/source.py
streams them to Ray Data). Parsing and validating happen in the actors, so a bad row becomes
an error record instead of a crash. A JSONL column with mixed types (`"width": 2` in one row,
`"width": "two"` in the next) would make Arrow's JSON reader fail the whole file; reading
lines as text avoids that.

Row ids: a row's `id` field (string or integer) if it has one, else `row<index>-<hash>`, where
`index` is the row's position in the whole input (0-based, across its files in their order,
blank JSONL lines not counted) and `hash` the row's content hash: the first 12 hex digits of
the SHA-256 of its canonical JSON (null fields left out, keys sorted, separators "," and ":";
the raw line if it is not JSON), so a row hashes the same from JSONL and from Parquet. The
index tells duplicates apart. Every record also carries its row's hash (`row_hash`), so that a
resume decodes again a row whose content changed under the same id. Ids must be unique: a
repeated id is an error record for the later rows.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from deployments.api.models import ChatMessage
from deployments.api.penalty_fields import LogitBiasField
from deployments.api.stop_fields import StopFields
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.methods import Method

InputFormat = Literal["jsonl", "parquet"]
INPUT_SUFFIXES: dict[str, InputFormat] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
# What the actors receive: one row each.
ROWS_SCHEMA = pa.schema(
    [
        ("index", pa.int64()),
        ("id", pa.string()),
        ("row_hash", pa.string()),
        ("row", pa.string()),
        ("problem", pa.string()),
    ]
)
# logit_bias is a JSON object on the wire (`LogitBiasField`, as on the HTTP routes)
KNOBS = tuple(
    name for name in SamplingConfig.model_fields if name not in ("eos_token_ids", "logit_bias")
)

_RowKnobs: type[BaseModel] = create_model(  # type: ignore[call-overload]  # create_model's overloads miss **fields
    "_RowKnobs",
    __config__=ConfigDict(extra="forbid"),
    **{
        name: (SamplingConfig.model_fields[name].annotation, SamplingConfig.model_fields[name])
        for name in KNOBS
    },
)


class BatchRow(_RowKnobs, StopFields, LogitBiasField):
    """One input row: a prompt in one of three forms, an optional id and per-row knobs.

    Knobs (SamplingConfig's fields, `method`, `n`, `chat`) override the command line's defaults
    for this row only; a field given as null counts as absent (Parquet and JSONL columns hold
    nulls for rows that lack them), so `threshold: "none"` asks for fixed width. Unknown fields
    are errors, not silently ignored (a typo such as `widht` would otherwise decode with the
    default).
    """

    model_config = ConfigDict(extra="forbid")

    id: str | int | None = Field(None, description="Stable id (default: derived, see module).")
    prompt: str | None = Field(None, min_length=1, description="Prompt text.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="A chat.")
    prompt_ids: list[int] | None = Field(None, min_length=1, description="Prompt token ids.")
    chat: bool | None = Field(None, description="Chat-template `prompt` (default: --chat).")
    method: Method | None = Field(
        None, description="dsbd, beam, sps, sample, beam_search or spec_beam_search."
    )
    n: int | None = Field(None, ge=1, le=64, description="Beams to return (default: all).")

    @field_validator("threshold", mode="before")
    @classmethod
    def _none_means_fixed_width(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @model_validator(mode="after")
    def _one_prompt(self) -> BatchRow:
        given = [n for n in ("prompt", "messages", "prompt_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            shown = ", ".join(given) if given else "none of them"
            raise ValueError(f"give exactly one of prompt, messages, prompt_ids (got {shown})")
        if self.prompt_ids is not None and min(self.prompt_ids) < 0:
            raise ValueError(f"prompt_ids: token id {min(self.prompt_ids)} is negative")
        return self

    def knobs(self) -> dict[str, Any]:
        """The SamplingConfig fields this row sets (the others come from the command line)."""
        knobs = {name: getattr(self, name) for name in KNOBS if name in self.model_fields_set}
        if self.logit_bias is not None:
            knobs["logit_bias"] = self.logit_bias_ids
        return knobs


def parse_row(text: str) -> BatchRow:
    """A row from its JSON text; nulls dropped (absent). Raises ValueError / ValidationError."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON: {error}") from None
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"a row must be a JSON object, got {type(value).__name__}")
    return BatchRow.model_validate({k: v for k, v in value.items() if v is not None})


def input_format(path: str) -> InputFormat | None:
    """The format a path's suffix names (in any case), or None."""
    lower = path.lower().rstrip("/")
    return next((f for s, f in INPUT_SUFFIXES.items() if lower.endswith(s)), None)


def uri(path: str) -> str:
    """pyarrow wants absolute local paths; URIs (s3://, gs://, file://) pass through."""
    if "://" in path:
        return path
    from pathlib import Path

    return str(Path(path).expanduser().resolve())


def row_key(text: str, index: int) -> tuple[str, str]:
    """A row's id and content hash (see the module docstring), from its text (JSON parsed once):
    the planning pass and the read tasks both call this, so both derive the same ids."""
    try:
        value = json.loads(text)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):  # not JSON (or nested too deeply to parse)
        value, canonical = None, text
    row_hash = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    given = value.get("id") if isinstance(value, dict) else None
    if isinstance(given, str | int) and not isinstance(given, bool):
        return str(given), row_hash
    return f"row{index}-{row_hash}", row_hash


def content_hash(text: str) -> str:
    """A row's content hash (see the module docstring)."""
    return row_key(text, 0)[1]


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (`ROWS_SCHEMA` dicts) as the Arrow block the actors receive."""
    return pa.Table.from_pylist(rows, schema=ROWS_SCHEMA)
