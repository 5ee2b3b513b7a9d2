"""`dsbd batch` input: which files, in which order, and the planning pass over them.

`--input` is a file or a directory. A directory is read recursively: every `.jsonl`,
`.ndjson` and `.parquet` file (suffix in any case) whose path below the directory has no part
starting with `_` or `.` (`_SUCCESS`, `.crc`, `_incomplete/`: what pyarrow and Ray Data skip
too), in the order of that relative path compared character by character (Python's `sorted`,
`LC_ALL=C ls`: `B.jsonl` before `a.jsonl`, `part-10` before `part-2`). Files of other
suffixes are left out (the job names them). The rows of the input are the rows of its files
in that order, so a row's `index`, and with it a derived id, is its position in the whole
input: the same whether the files are read one by one, split into several read tasks, or
concatenated into one file.

Rows stream to the actors through Ray Data (deployments/batch_job/source.py), but resume and the
duplicate-id rule need every row's key before any row is decoded (docs/BATCH.md): which rows
the output already holds (they reach no actor, and the skipped count is printed), which old
records to remove before their rows are decoded again, which later rows repeat an earlier id,
and whether there is anything to do at all (else Ray is not even started). So `plan_input`
makes one streaming pass over the input on the driver before the pipeline starts: it reads
each file in chunks (JSONL: 1 MiB at a time, lines found by a byte scan; Parquet: one row group
at a time), hashes every row, and keeps 16 bytes a row (the id's fingerprint,
deployments/batch_job/keys.py) and one bit a row (decode it or not), never the rows themselves.
It also cuts the input into splits, the read tasks' parts: consecutive rows of one file,
about `SPLIT_BYTES` each (JSONL: byte ranges ending at a line end, with the global index of
their first row; Parquet: runs of row groups, counted from the footer). A read task reads its
split again, derives the same ids (same code, same positions) and yields only the rows the
plan marked; a file changed since the plan (size or modification time) fails the job instead
of giving rows other positions.

JSONL lines end at `\\n` (`\\r\\n` too); a byte-order mark at a file's start is dropped; lines
are decoded as UTF-8 (invalid bytes replaced) and blank lines are no rows.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deployments.batch_job.keys import KeySet, fingerprint, pack
from deployments.batch_job.rows import INPUT_SUFFIXES, InputFormat, input_format, row_key, uri

SPLIT_BYTES = 64 << 20  # a read task's share of a file (a split holds at least one row)
CHUNK_BYTES = 1 << 20  # JSONL bytes read at a time
PARQUET_BATCH_ROWS = 256  # Parquet rows converted to Python at a time, at most
PARQUET_BATCH_BYTES = 4 << 20  # ... and about this many bytes of them
KEY_CHUNK_ROWS = 1 << 16  # rows whose keys are looked up in the output's at once


class InputError(Exception):
    """The input cannot be used; the message names the file but not the flag."""


@dataclass(frozen=True)
class InputFile:
    """One input file, as listed when the job started (a read checks it is unchanged)."""

    filesystem: Any  # pyarrow FileSystem (picklable: read tasks open the file themselves)
    path: str  # on that filesystem
    name: str  # for messages: the path below --input (a file: its name)
    fmt: InputFormat
    size: int
    mtime_ns: int | None


@dataclass
class Split:
    """Consecutive rows of one file: one read task's share of the input."""

    file: InputFile
    first: int  # global index of the split's first row
    rows: int  # rows in the split (blank JSONL lines are none)
    start: int  # JSONL: byte offset of its first line; Parquet: its first row group
    stop: int  # JSONL: byte offset after its last line; Parquet: the row group after its last
    size: int  # bytes (Parquet: uncompressed row groups)
    pending: bytes = b""  # numpy.packbits of "decode this row", one bit per row
    todo: int = 0  # rows to decode
    duplicates: dict[int, int] = field(default_factory=dict)  # index -> first row of its id


@dataclass
class InputPlan:
    """The planning pass's result: what to read, what to decode, what resume drops."""

    splits: list[Split]
    rows: int  # rows of the whole input
    todo: int  # rows to decode
    size: int  # bytes of the input files
    redo: KeySet  # ids of the rows to decode (their old records are removed first)
    keep: KeySet  # final output keys that are rows of this input (kept)


@dataclass
class InputListing:
    """What `--input` names: its files in their order, and what was left out."""

    files: list[InputFile]
    ignored: list[str]  # names of files of other suffixes in the directory
    directory: str | None  # the directory's path on its filesystem (None: a file)


# --------------------------------------------------------------------------- files
def find_input(path: str) -> InputListing:
    """The input files in their order, and the names of the files left out (other suffixes);
    raises InputError (no such path, unknown suffix, a directory without input files)."""
    import pyarrow.fs as pafs

    allowed = ", ".join(INPUT_SUFFIXES)
    filesystem, where = pafs.FileSystem.from_uri(uri(path))
    info = filesystem.get_file_info(where)
    if info.type != pafs.FileType.Directory:
        fmt = input_format(path)
        if fmt is None:
            raise InputError(f"unknown suffix; allowed: {allowed}, or a directory of such files")
        if info.type == pafs.FileType.NotFound:
            raise InputError("no such file or directory")
        name = posixpath.basename(where)
        file = InputFile(filesystem, where, name, fmt, info.size, info.mtime_ns)
        return InputListing([file], [], None)
    files, ignored = [], []
    selector = pafs.FileSelector(where, recursive=True)
    for entry in filesystem.get_file_info(selector):
        name = posixpath.relpath(entry.path, where)
        if entry.type != pafs.FileType.File or _hidden(name):
            continue
        fmt = input_format(name)
        if fmt is None:
            ignored.append(name)
            continue
        files.append(InputFile(filesystem, entry.path, name, fmt, entry.size, entry.mtime_ns))
    if not files:
        raise InputError(f"a directory without input files; allowed: {allowed} files in it")
    return InputListing(sorted(files, key=lambda f: f.name), sorted(ignored), where)


def _hidden(name: str) -> bool:
    return any(part.startswith(("_", ".")) for part in name.split("/"))


def check_unchanged(file: InputFile) -> None:
    """Raise InputError if the file is not the one the plan read (rows would move)."""
    info = file.filesystem.get_file_info(file.path)
    if info.size != file.size or (file.mtime_ns is not None and info.mtime_ns != file.mtime_ns):
        raise InputError(
            f"{file.name} changed since the job planned it (size or modification time); "
            "rerun the same command: what was written so far is kept"
        )


# --------------------------------------------------------------------------- reading
def jsonl_texts(stream: Any, start: int, stop: int) -> Iterator[tuple[str, int]]:
    """The non-blank lines in bytes [start, stop) of a JSONL file (stop: a line end or the
    file's end), each with the offset just after it. Reads CHUNK_BYTES at a time, so a line is
    the most this holds."""
    stream.seek(start)
    line_start, position, tail = start, start, []
    while position < stop:
        chunk = stream.read(min(CHUNK_BYTES, stop - position))
        if not chunk:
            break
        position += len(chunk)
        pieces = chunk.split(b"\n")
        if len(pieces) == 1:  # inside a long line: joined once it ends, not chunk by chunk
            tail.append(chunk)
            continue
        pieces[0] = b"".join([*tail, pieces[0]])
        last = pieces.pop()  # after the last newline: the start of a line not ended yet
        tail = [last] if last else []
        for piece in pieces:
            line_end = line_start + len(piece) + 1
            text = _line_text(piece, line_start)
            if text is not None:
                yield text, line_end
            line_start = line_end
    if tail:
        line = b"".join(tail)
        text = _line_text(line, line_start)
        if text is not None:
            yield text, line_start + len(line)


def _line_text(line: bytes, offset: int) -> str | None:
    text = line.decode("utf-8", errors="replace")
    if offset == 0 and text.startswith("\ufeff"):
        text = text[1:]
    if text.endswith("\r"):
        text = text[:-1]
    return text if text.strip() else None


def parquet_texts(parquet: Any, groups: list[int]) -> Iterator[str]:
    """The rows of some row groups of a `pyarrow.parquet.ParquetFile` as JSON text, in order,
    a few MiB of rows at a time (the file is opened with a read buffer, see `open_parquet`)."""
    if not groups:
        return
    meta = parquet.metadata
    rows = sum(meta.row_group(g).num_rows for g in groups)
    size = sum(meta.row_group(g).total_byte_size for g in groups)
    per_row = max(1, size // max(rows, 1))
    batch_rows = max(1, min(PARQUET_BATCH_ROWS, PARQUET_BATCH_BYTES // per_row))
    batches = parquet.iter_batches(batch_size=batch_rows, row_groups=groups, use_threads=False)
    for batch in batches:
        for row in batch.to_pylist():
            yield json.dumps(row, default=str)


def open_parquet(stream: Any) -> Any:
    """A ParquetFile that reads column chunks through a buffer instead of whole (a row group
    can be hundreds of MB)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(stream, buffer_size=CHUNK_BYTES, pre_buffer=False)


def split_texts(split: Split) -> Iterator[str]:
    """A split's rows as text (the read tasks' side of the plan)."""
    file = split.file
    with file.filesystem.open_input_file(file.path) as stream:
        if file.fmt == "jsonl":
            for text, _ in jsonl_texts(stream, split.start, split.stop):
                yield text
            return
        yield from parquet_texts(open_parquet(stream), list(range(split.start, split.stop)))


def split_rows(split: Split) -> Iterator[dict[str, Any]]:
    """The rows of a split the plan marked, as `ROWS_SCHEMA` dicts: index, id and row_hash as
    the plan derived them, `problem` for a repeated id. Raises InputError when the file
    changed since the plan."""
    check_unchanged(split.file)
    marks = np.frombuffer(split.pending, np.uint8)
    pending = np.unpackbits(marks, count=split.rows).astype(bool).tolist()
    seen = 0
    for offset, text in enumerate(split_texts(split)):
        seen = offset + 1
        if seen > split.rows:
            break
        if not pending[offset]:
            continue
        index = split.first + offset
        row_id, row_hash = row_key(text, index)
        first = split.duplicates.get(index)
        problem = None
        if first is not None:
            problem = f"id={row_id!r} is also the id of row {first}; ids must be unique"
        yield {"index": index, "id": row_id, "row_hash": row_hash, "row": text, "problem": problem}
    if seen != split.rows:
        raise InputError(
            f"{split.file.name} holds other rows than when the job planned it; rerun the "
            "same command: what was written so far is kept"
        )


# --------------------------------------------------------------------------- planning
def plan_input(
    files: list[InputFile], done: KeySet, *, split_bytes: int = SPLIT_BYTES
) -> InputPlan:
    """The planning pass (module docstring): every row's key against `done` (the output's
    final keys), the splits, repeated ids. Raises InputError for a file that cannot be read."""
    planner = _Planner(done, split_bytes)
    for file in files:
        check_unchanged(file)
        try:
            if file.fmt == "jsonl":
                planner.scan_jsonl(file)
            else:
                planner.scan_parquet(file)
        except (OSError, ValueError) as error:  # pyarrow's errors derive from these
            raise InputError(f"{file.name}: cannot read it: {error}") from None
    return planner.finish(size=sum(file.size for file in files))


class _Planner:
    """Accumulates the pass: keys looked up KEY_CHUNK_ROWS at a time, one split at a time."""

    def __init__(self, done: KeySet, split_bytes: int) -> None:
        self.done, self.split_bytes = done, split_bytes
        self.hit = np.zeros(len(done), bool)  # done keys met in the input (kept)
        self.index = 0  # rows so far
        self.splits: list[Split] = []
        self.ids: list[np.ndarray] = []  # id fingerprints of all rows, in order
        self.redo: list[np.ndarray] = []  # id fingerprints of the rows to decode
        self.marks: list[np.ndarray] = []  # "decode it" of the open split's flushed rows
        self.id_buffer: list[bytes] = []
        self.key_buffer: list[bytes] = []

    def add(self, text: str) -> None:
        row_id, row_hash = row_key(text, self.index)
        self.index += 1
        self.id_buffer.append(fingerprint(row_id))
        self.key_buffer.append(fingerprint(row_id, row_hash))
        if len(self.id_buffer) >= KEY_CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        ids, keys = pack(self.id_buffer), pack(self.key_buffer)
        self.id_buffer, self.key_buffer = [], []
        found, where = self.done.positions(keys)
        self.hit[where[found]] = True
        self.ids.append(ids)
        self.redo.append(ids[~found])
        self.marks.append(~found)

    def close(self, file: InputFile, first: int, start: int, stop: int, size: int) -> None:
        """End the open split (rows `first`.. so far) at `stop`."""
        self.flush()
        marks = np.concatenate(self.marks)
        self.marks = []
        if len(marks):
            packed = np.packbits(marks).tobytes()
            todo = int(marks.sum())
            self.splits.append(Split(file, first, len(marks), start, stop, size, packed, todo))

    def scan_jsonl(self, file: InputFile) -> None:
        with file.filesystem.open_input_file(file.path) as stream:
            first, start = self.index, 0
            for text, end in jsonl_texts(stream, 0, file.size):
                self.add(text)
                if end - start >= self.split_bytes:
                    self.close(file, first, start, end, end - start)
                    first, start = self.index, end
            self.close(file, first, start, file.size, file.size - start)

    def scan_parquet(self, file: InputFile) -> None:
        with file.filesystem.open_input_file(file.path) as stream:
            parquet = open_parquet(stream)
            meta = parquet.metadata
            first, start, size = self.index, 0, 0
            for group in range(meta.num_row_groups):
                for text in parquet_texts(parquet, [group]):
                    self.add(text)
                size += meta.row_group(group).total_byte_size
                if size >= self.split_bytes:
                    self.close(file, first, start, group + 1, size)
                    first, start, size = self.index, group + 1, 0
            self.close(file, first, start, meta.num_row_groups, size)

    def finish(self, size: int) -> InputPlan:
        self.flush()
        repeated = duplicate_rows(np.concatenate(self.ids))
        firsts = [split.first for split in self.splits]
        for index, first in sorted(repeated.items()):
            split = self.splits[int(np.searchsorted(firsts, index, side="right")) - 1]
            split.duplicates[index] = first
        return InputPlan(
            splits=self.splits,
            rows=self.index,
            todo=sum(split.todo for split in self.splits),
            size=size,
            redo=KeySet(np.concatenate(self.redo)),
            keep=KeySet(self.done.values[self.hit]),
        )


def duplicate_rows(ids: np.ndarray) -> dict[int, int]:
    """Rows whose id an earlier row has (fingerprints in row order): index -> the first row
    with that id. A stable sort keeps equal ids in row order, so a run's head is the first."""
    if len(ids) < 2:
        return {}
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    same = ranked[1:] == ranked[:-1]
    repeats = np.flatnonzero(same) + 1  # positions in `ranked` equal to the one before
    if not len(repeats):
        return {}
    heads = np.flatnonzero(np.concatenate([[True], ~same]))  # where each run of an id starts
    head_of = heads[np.searchsorted(heads, repeats, side="right") - 1]
    return dict(zip(order[repeats].tolist(), order[head_of].tolist(), strict=True))
