"""`dsbd batch` output: the record schema, and the output directory as the job's checkpoint.

Ray Data writes one file per write task into the output directory, named
`<run>_<write uuid>_<task>.<ext>` (`<run>`: start time + random, new for every run). Nothing else
is needed to resume: the records already there ARE the checkpoint. A row is done when a record
with its id and its content hash (`row_hash`) is final: a result, or an `invalid_row` error
(the row itself is wrong, so the same settings would fail it the same way). A re-run on the
same output

* skips the done rows (no decoding for them);
* decodes the others: rows without a record, rows whose record is a `decode_failed` error
  (something went wrong while decoding: worth another try) and rows edited since (same id,
  other content). Their old records are removed first (the files that hold them are rewritten
  without them, through a `_`-prefixed temporary file and a rename), so that after a complete
  run the directory holds one record per input row;
* moves files it cannot read (a write cut short when a job was killed: Ray Data writes files
  in place) into `_incomplete/`, and decodes their rows again.

`_dsbd_batch.json` records the settings that decide a row's result (models, dtype, default
knobs); a re-run with other settings is refused (exit 2) instead of mixing results of two
configurations; `--overwrite` starts afresh. Files and folders whose names start with `_` or
`.` are skipped by pyarrow's and Ray Data's dataset readers, so the directory reads as one
dataset: `pyarrow.dataset.dataset(DIR)` or `ray.data.read_parquet(DIR)` / `read_json(DIR)`.

Why not Ray Data's own checkpointing (`DataContext.checkpoint_config`): it filters rows at a
read operator by an id column the input must already hold (ids here may be derived), it
records every written row, so a failed row would never be retried, and it deletes its state
when the job succeeds by default, so a re-run after success would decode everything again.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from deployments.batch_job.keys import KeySet, fingerprints
from deployments.batch_job.rows import uri

OutputFormat = Literal["parquet", "jsonl"]
EXTENSIONS: dict[OutputFormat, str] = {"parquet": "parquet", "jsonl": "jsonl"}
MANIFEST = "_dsbd_batch.json"
INCOMPLETE = "_incomplete"

_INT = pa.int64()
BEAM = pa.struct(
    [
        ("text", pa.string()),
        ("token_ids", pa.list_(_INT)),
        ("log_likelihood", pa.float64()),
        ("score", pa.float64()),
        ("finished", pa.bool_()),
        ("stop_reason", pa.string()),  # the stop string the beam finished at (row `stop`)
        # with `logprobs` asked (row field or --logprobs): each token's target log-probability
        # and the most likely tokens at its position; null otherwise
        ("token_logprobs", pa.list_(pa.float64())),
        (
            "top_logprobs",
            pa.list_(pa.list_(pa.struct([("token_id", _INT), ("logprob", pa.float64())]))),
        ),
    ]
)
STATS = pa.struct(
    [
        ("iterations", _INT),
        ("target_forward_passes", _INT),
        ("draft_forward_passes", _INT),
        ("tokens_emitted", _INT),
        ("drafted_tokens", _INT),
        ("accepted_tokens", _INT),
        ("acceptance_rate", pa.float64()),
        ("target_passes_per_token", pa.float64()),
        ("mean_accepted_length", pa.float64()),
        ("accepted_layers", pa.list_(_INT)),
        ("widths", pa.list_(pa.list_(_INT))),
        ("epsilon_bias_bound", pa.float64()),
        ("seconds", pa.float64()),
        ("batch_rows", _INT),
    ]
)
# One record per input row. Error records carry id, index, row_hash and the error; the rest
# is null. error_kind: "invalid_row" (final) or "decode_failed" (retried by a re-run).
OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("index", _INT),
        ("row_hash", pa.string()),
        ("text", pa.string()),
        ("token_ids", pa.list_(_INT)),
        ("finish_reason", pa.string()),
        ("stop_reason", pa.string()),
        ("beams", pa.list_(BEAM)),
        ("prompt_tokens", _INT),
        ("method", pa.string()),
        ("seed", _INT),
        ("stats", STATS),
        ("error", pa.string()),
        ("error_kind", pa.string()),
    ]
)
ErrorKind = Literal["invalid_row", "decode_failed"]


def error_record(row: dict[str, Any], kind: ErrorKind, error: str) -> dict[str, Any]:
    """The record of an input row (`ROWS_SCHEMA`) that could not be decoded."""
    keys = ("id", "index", "row_hash")
    return {**{k: row[k] for k in keys}, "error": error, "error_kind": kind}


@dataclass
class OutputState:
    """What an output directory already holds."""

    final: KeySet = field(default_factory=KeySet)  # (id, row_hash) of final records
    files: list[str] = field(default_factory=list)  # readable data files
    moved: list[str] = field(default_factory=list)  # unreadable files moved to _incomplete/

    def pending(self, keys: list[tuple[str, str]]) -> list[int]:
        """Positions of the input rows (their (id, row_hash)) that still need decoding."""
        return np.flatnonzero(~self.final.contains(fingerprints(keys))).tolist()


class OutputDir:
    """The output directory on its pyarrow filesystem (local path or URI such as s3://)."""

    def __init__(self, path: str, fmt: OutputFormat) -> None:
        import pyarrow.fs as pafs

        self.uri = uri(path)
        self.filesystem, self.path = pafs.FileSystem.from_uri(self.uri)
        self.fmt = fmt
        self.extension = EXTENSIONS[fmt]

    # ----------------------------------------------------------------- layout
    def kind(self) -> str:
        """'missing', 'file' or 'dir'."""
        import pyarrow.fs as pafs

        info = self.filesystem.get_file_info(self.path)
        if info.type == pafs.FileType.NotFound:
            return "missing"
        return "dir" if info.type == pafs.FileType.Directory else "file"

    def entries(self) -> list[str]:
        """Names directly inside the directory."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path, allow_not_found=True)
        return sorted(posixpath.basename(i.path) for i in self.filesystem.get_file_info(selector))

    def data_files(self, prefix: str = "") -> list[str]:
        """Data files of this format (not `_`/`.`-prefixed), optionally of one run."""
        return [
            posixpath.join(self.path, name)
            for name in self.entries()
            if name.endswith("." + self.extension)
            and not name.startswith(("_", "."))
            and name.startswith(prefix)
        ]

    def foreign_files(self) -> list[str]:
        """Data-looking files of the other format (a re-run with another --format)."""
        other = [e for f, e in EXTENSIONS.items() if f != self.fmt]
        return [n for n in self.entries() if n.rsplit(".", 1)[-1] in other]

    def read_manifest(self) -> dict[str, Any] | None:
        try:
            with self.filesystem.open_input_stream(posixpath.join(self.path, MANIFEST)) as f:
                return json.loads(f.read().decode())
        except (FileNotFoundError, OSError, json.JSONDecodeError):
            return None

    def write_manifest(self, settings: dict[str, Any]) -> None:
        self.filesystem.create_dir(self.path, recursive=True)
        self._replace(MANIFEST, json.dumps(settings, indent=2, sort_keys=True).encode())

    def clear(self) -> None:
        """--overwrite: remove everything in the directory."""
        if self.kind() == "dir":
            self.filesystem.delete_dir_contents(self.path)

    # ----------------------------------------------------------------- records
    def read(self, path: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
        """A data file's records (raises if the file is not complete)."""
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, filesystem=self.filesystem, columns=columns).to_pylist()
        with self.filesystem.open_input_stream(path) as stream:
            text = stream.read().decode()
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        if text and not text.endswith("\n"):
            raise ValueError(f"{path}: the last line is cut short")
        keep = columns or []
        return [{k: r.get(k) for k in keep} for r in records] if keep else records

    def scan(self) -> OutputState:
        """The final records' keys (as fingerprints: 16 bytes a record, whatever the output
        holds); unreadable files moved aside."""
        state = OutputState()
        final = []
        for path in self.data_files():
            try:
                records = self.read(path, ["id", "row_hash", "error_kind"])
            except Exception:  # a file cut short by a killed job: its rows are decoded again
                self._move_incomplete(path)
                state.moved.append(path)
                continue
            state.files.append(path)
            done = (r for r in records if r["error_kind"] in (None, "invalid_row"))
            final.append(fingerprints((r["id"], r["row_hash"]) for r in done))
        state.final = KeySet.union(final)
        return state

    def drop_stale(
        self, files: list[str], redo: KeySet | Iterable[str], keep: KeySet | Iterable[Any]
    ) -> int:
        """Remove the old records of rows decoded again: a record whose id is in `redo` (ids of
        the rows to decode) and whose (id, row_hash) is not in `keep` (final records of rows
        that are done). Files rewritten atomically; returns how many records went."""
        redo, keep = KeySet.of(redo), KeySet.of(keep)
        dropped = 0
        for path in files if len(redo) else []:
            keys = self.read(path, ["id", "row_hash"])
            stale = redo.contains(fingerprints(r["id"] for r in keys))
            stale &= ~keep.contains(fingerprints((r["id"], r["row_hash"]) for r in keys))
            if not stale.any():
                continue
            records = self.read(path)
            fresh = [r for r, old in zip(records, stale.tolist(), strict=True) if not old]
            dropped += len(records) - len(fresh)
            if not fresh:
                self.filesystem.delete_file(path)
                continue
            table = pa.Table.from_pylist(fresh, schema=OUTPUT_SCHEMA)
            self._replace(posixpath.basename(path), self.encode(table))
        return dropped

    def encode(self, table: pa.Table) -> bytes:
        """A table as this format's file bytes (what Ray Data's writers produce)."""
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            return sink.getvalue().to_pybytes()
        return "".join(json.dumps(r) + "\n" for r in table.to_pylist()).encode()

    def summary(self, run: str) -> dict[str, Any]:
        """Counts of one run's records: rows written, failed, tokens emitted."""
        ok = failed = tokens = 0
        for path in self.data_files(prefix=run):
            for record in self.read(path, ["error", "stats"]):
                if record["error"] is None:
                    ok += 1
                    tokens += int(record["stats"]["tokens_emitted"])
                else:
                    failed += 1
        return {"decoded": ok, "failed": failed, "tokens": tokens}

    # ----------------------------------------------------------------- helpers
    def _replace(self, name: str, data: bytes) -> None:
        """Write `name` through a `_`-prefixed temporary file and a rename (atomic locally)."""
        temporary = posixpath.join(self.path, f"_tmp-{name}")
        with self.filesystem.open_output_stream(temporary) as stream:
            stream.write(data)
        self.filesystem.move(temporary, posixpath.join(self.path, name))

    def _move_incomplete(self, path: str) -> None:
        folder = posixpath.join(self.path, INCOMPLETE)
        self.filesystem.create_dir(folder, recursive=True)
        self.filesystem.move(path, posixpath.join(folder, posixpath.basename(path)))
