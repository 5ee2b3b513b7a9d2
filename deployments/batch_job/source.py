"""The Ray Data read of `dsbd batch`: a Datasource of the planned splits of the input.

`ray.data.read_json` / `read_parquet` cannot be used as they are: a read task sees its file with
no row offset, so derived ids (`row<index>-<hash>`, index = position in the whole input) could
not be formed; `read_json` fails the job on one bad line (pandas on text that is not JSON,
Arrow on a field whose type changes between rows) where a bad row must become an error
record; and neither skips the rows the output holds. This Datasource reads the splits that
`deployments.batch_job.inputs.plan_input` cut (consecutive rows of one file, with the global index
of the first): one read task per split, reading its file itself (so rows go from storage to
the read task's worker and on to the actors through the object store, never through the
driver), yielding only the rows the plan marked, `batch_size` rows a block: a block is one
actor call and one written file, as before, so what a killed job has decoded is on disk.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from deployments.batch_job.inputs import Split, split_rows
from deployments.batch_job.rows import ROWS_SCHEMA, rows_table


class BatchInputDatasource(Datasource):
    """The rows still to decode, split by split (one read task each)."""

    def __init__(self, splits: list[Split], batch_size: int) -> None:
        super().__init__()
        self.splits = [split for split in splits if split.todo]
        self.batch_size = batch_size

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(_todo_bytes(split) for split in self.splits)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        """One task per split whatever `parallelism` asks: a split is the unit whose first row
        index the plan knows (the job passes `override_num_blocks=len(splits)`)."""
        return [
            ReadTask(
                functools.partial(read_split, split, self.batch_size),
                BlockMetadata(
                    num_rows=split.todo,
                    size_bytes=_todo_bytes(split),
                    exec_stats=None,
                    input_files=(split.file.path,),
                ),
                schema=ROWS_SCHEMA,
                per_task_row_limit=per_task_row_limit,
            )
            for split in self.splits
        ]


def read_split(split: Split, batch_size: int) -> Iterator[pa.Table]:
    """A read task: the split's marked rows, `batch_size` rows a block."""
    block: list[dict[str, Any]] = []
    for row in split_rows(split):
        block.append(row)
        if len(block) == batch_size:
            yield rows_table(block)
            block = []
    if block:
        yield rows_table(block)


def _todo_bytes(split: Split) -> int:
    return split.size * split.todo // max(split.rows, 1)
