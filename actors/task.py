"""The description of one job shard that the driver hands to an actor.

Kept apart from :mod:`actors.shard` (which imports the engine's modules, torch among them) so
that unpickling a task imports only this module and pyarrow: an actor is created with its
first task as an argument, and Ray unpickles the arguments before the constructor runs, that
is before ``actors.actor.cache_bytecode`` lets the process read and write its bytecode cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs


@dataclass(slots=True)
class ShardTask:
    """Everything an actor needs to process one shard (plain and picklable)."""

    shard_id: int
    attempt: int
    input_fs: pafs.FileSystem
    input_path: str
    input_format: str  # "parquet" | "ipc" | "json"
    row_start: int
    row_stop: int
    columns: dict[str, str]  # role (id, prompt, messages, token_ids, params) -> column name
    default_params: dict[str, Any]
    seed: int
    output_fs: pafs.FileSystem
    output_dir: str
    schema: pa.Schema
    id_offset: int | None = None  # global index of the file's first row, when ids are generated
    deterministic: bool = True  # run alone on an idle engine: rows depend on the shard only
    max_num_seqs: int | None = None  # the engine's: a row asking for more samples fails
    write_sampling_params: bool = False  # the schema's sampling_params column is generated

    @property
    def part_name(self) -> str:
        return f"part-{self.shard_id:05d}.parquet"

    @property
    def temp_name(self) -> str:
        return f".part-{self.shard_id:05d}-{self.attempt}.parquet.tmp"
