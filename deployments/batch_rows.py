"""`dsbd batch` input: reading the prompts file, row ids, and the per-row request model.

The driver reads the input once (pyarrow, any filesystem pyarrow knows) and hands Ray Data one
string column per row, `row` (the row as JSON), next to its `index` and `id`: parsing and
validating happen in the actors, so a bad row becomes an error record instead of a crash. A
JSONL column with mixed types (`"width": 2` in one row, `"width": "two"` in the next) would make
Arrow's JSON reader fail the whole file; reading lines as text avoids that.

Row ids: a row's `id` field (string or integer) if it has one, else `row<index>-<hash>`, where
`index` is the row's position in the input (0-based, blank JSONL lines not counted) and `hash`
the row's content hash: the first 12 hex digits of the SHA-256 of its canonical JSON (null
fields left out, keys sorted, separators "," and ":"; the raw line if it is not JSON), so a row
hashes the same from JSONL and from Parquet. The index tells duplicates apart. Every record
also carries its row's hash (`row_hash`), so that a resume decodes again a row whose content
changed under the same id. Ids must be unique: a repeated id is an error record for the later
rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from deployments.api_models import ChatMessage, Method
from dsbd_core.algorithm.config import SamplingConfig

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
KNOBS = tuple(name for name in SamplingConfig.model_fields if name != "eos_token_ids")

_RowKnobs: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "_RowKnobs",
    __config__=ConfigDict(extra="forbid"),
    **{
        name: (SamplingConfig.model_fields[name].annotation, SamplingConfig.model_fields[name])
        for name in KNOBS
    },
)


class BatchRow(_RowKnobs):  # type: ignore[misc, valid-type]
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
    method: Method | None = Field(None, description="dsbd, beam, sps or sample.")
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
        return {name: getattr(self, name) for name in KNOBS if name in self.model_fields_set}


def parse_row(text: str) -> BatchRow:
    """A row from its JSON text; nulls dropped (absent). Raises ValueError / ValidationError."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a row must be a JSON object, got {type(value).__name__}")
    return BatchRow.model_validate({k: v for k, v in value.items() if v is not None})


@dataclass
class InputRows:
    """The rows of an input file, ready for Ray Data (one `ROWS_SCHEMA` record each)."""

    index: list[int]
    id: list[str]
    row_hash: list[str]
    row: list[str]
    problem: list[str | None]

    def __len__(self) -> int:
        return len(self.id)

    def keys(self) -> list[tuple[str, str]]:
        """(id, row_hash) of every row: what a record must match to count as this row's."""
        return list(zip(self.id, self.row_hash, strict=True))

    def table(self, keep: list[int]) -> pa.Table:
        """The rows at positions `keep` as an Arrow table."""
        columns = ("index", "id", "row_hash", "row", "problem")
        return pa.table(
            {name: [getattr(self, name)[i] for i in keep] for name in columns}, schema=ROWS_SCHEMA
        )


def input_format(path: str) -> InputFormat | None:
    """The format a path's suffix names, or None."""
    lower = path.lower().rstrip("/")
    return next((f for s, f in INPUT_SUFFIXES.items() if lower.endswith(s)), None)


def read_input(path: str, fmt: InputFormat) -> InputRows:
    """Read every row of the input (raises OSError / pyarrow errors when it cannot be read)."""
    import pyarrow.fs as pafs

    filesystem, where = pafs.FileSystem.from_uri(uri(path))
    texts: list[str] = []
    if fmt == "jsonl":
        with filesystem.open_input_stream(where) as stream:
            lines = stream.read().decode("utf-8-sig", errors="replace").splitlines()
        texts = [line for line in lines if line.strip()]
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(where, filesystem=filesystem)
        texts = [json.dumps(row, default=str) for row in table.to_pylist()]
    rows = InputRows([], [], [], [], [])
    first_at: dict[str, int] = {}
    for index, text in enumerate(texts):
        row_hash = content_hash(text)
        row_id = _given_id(text)
        if row_id is None:
            row_id = f"row{index}-{row_hash}"
        problem = None
        if row_id in first_at:
            problem = f"id={row_id!r} is also the id of row {first_at[row_id]}; ids must be unique"
        else:
            first_at[row_id] = index
        rows.index.append(index)
        rows.id.append(row_id)
        rows.row_hash.append(row_hash)
        rows.row.append(text)
        rows.problem.append(problem)
    return rows


def uri(path: str) -> str:
    """pyarrow wants absolute local paths; URIs (s3://, gs://, file://) pass through."""
    if "://" in path:
        return path
    from pathlib import Path

    return str(Path(path).expanduser().resolve())


def _given_id(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict) and isinstance(value.get("id"), str | int):
        if not isinstance(value["id"], bool):
            return str(value["id"])
    return None


def content_hash(text: str) -> str:
    """A row's content hash (see the module docstring)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        canonical = text
    else:
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
