"""Ray Data writers of `dsbd batch`: file names per run, and JSON Lines that keep integers exact.

Ray Data's `write_json` goes through pandas, where an integer column with nulls (`seed` of an
error record) becomes float: seeds above 2**53 would be rounded. The JSON Lines datasink here
writes each Arrow record with `json.dumps` instead. Files are named `<run>_...`, so a
run's own files can be found (its summary) among earlier runs' files.
"""

from __future__ import annotations

import json

import pyarrow
from ray.data.block import BlockAccessor
from ray.data.datasource import FilenameProvider
from ray.data.datasource.file_datasink import BlockBasedFileDatasink


class RunFiles(FilenameProvider):
    """`<run>_<write uuid>_<task index>.<extension>`: a run's files share its prefix.

    Ray Data's Parquet writer insists on the write's uuid in the name (it refuses a template
    without it, lest files be overwritten).
    """

    def __init__(self, run: str, extension: str) -> None:
        super().__init__(file_format=extension)
        self.run = run
        self.extension = extension

    def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
        return f"{self.run}_{write_uuid}_{task_index:06}.{self.extension}"


class JsonLinesDatasink(BlockBasedFileDatasink):
    """One JSON object per line, one file per write task."""

    def __init__(self, path: str, run: str) -> None:
        super().__init__(path, file_format="jsonl", filename_provider=RunFiles(run, "jsonl"))

    def write_block_to_file(self, block: BlockAccessor, file: pyarrow.NativeFile) -> None:
        lines = [json.dumps(record) + "\n" for record in block.to_arrow().to_pylist()]
        file.write("".join(lines).encode())
