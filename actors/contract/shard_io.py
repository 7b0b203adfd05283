"""A shard's input rows and its part file, shared by the worker (which reads a shard's rows and
commits its outputs) and the driver (which writes a shard that ran out of attempts as error rows).

The part file is written under a hidden temporary name (``.part-<shard>-<attempt>.parquet.tmp``)
and renamed to ``part-<shard>.parquet``; the driver then records the commit.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from actors.contract import jsonl, openai_batch
from actors.contract.schema import OUTPUT_COLUMNS, PARAMS_FIELD, build_table, parquet_options
from actors.contract.task import PartWriteError, ShardResult, ShardTask


@dataclass(slots=True)
class ErrorOutput:
    """An output row for a request that never ran (the schema's attributes, finish "error")."""

    error: str
    seed: int | None = None
    sample_index: int = 0
    output_text: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"
    stop_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    sampled_ranks: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


def read_rows(task: ShardTask) -> pa.Table:
    """The shard's input rows ``[row_start, row_stop)`` of its file, every column."""
    start, stop = task.row_start, task.row_stop
    if task.input_format == openai_batch.FORMAT:
        table = openai_batch.read_range(task.input_fs, task.input_path, task.columns, start,
                                        stop)
        return _check_count(task, table)
    if task.input_format == jsonl.FORMAT:
        table = jsonl.read_range(task.input_fs, task.input_path, task.columns.get("params"),
                                 start, stop)
        return _check_count(task, table)
    dataset = ds.dataset(task.input_path, format=task.input_format, filesystem=task.input_fs)
    pieces, offset = [], 0
    if task.input_format == "parquet":
        fragment = next(iter(dataset.get_fragments()))
        for group in fragment.split_by_row_group():
            num = group.row_groups[0].num_rows
            if offset + num > start and offset < stop:
                lo = max(start - offset, 0)
                pieces.append(group.to_table().slice(lo, min(stop, offset + num) - offset - lo))
            offset += num
            if offset >= stop:
                break
    else:
        for batch in dataset.to_batches():
            num = batch.num_rows
            if offset + num > start and offset < stop:
                lo = max(start - offset, 0)
                pieces.append(pa.Table.from_batches([batch.slice(lo, min(stop, offset + num)
                                                                 - offset - lo)]))
            offset += num
            if offset >= stop:
                break
    return _check_count(task, pa.concat_tables(pieces) if pieces
                        else dataset.schema.empty_table())


def _check_count(task: ShardTask, table: pa.Table) -> pa.Table:
    if table.num_rows != task.row_stop - task.row_start:
        raise ValueError(f"shard {task.shard_id}: {task.input_path} has fewer rows than planned "
                         f"(wanted rows {task.row_start}..{task.row_stop}); the input changed "
                         "during the job")
    return table


def row_ids(task: ShardTask, table: pa.Table) -> tuple[pa.Array, list[Any], dict[int, str]]:
    """The ids for the output column, their Python values, and the rows whose id is unusable
    (row -> reason; such an id is null in the output and in the values)."""
    column = task.columns.get("id")
    if task.id_offset is not None or column is None:
        base = (task.id_offset or 0) + task.row_start
        ids = pa.array([str(base + i) for i in range(table.num_rows)], type=pa.string())
        return ids, ids.to_pylist(), {}
    ids = table.column(column).combine_chunks().cast(task.schema.field("id").type)
    try:
        return ids, ids.to_pylist(), {}
    except UnicodeDecodeError:  # a string id that is not UTF-8: that row fails, not the shard
        values, bad = [], {}
        for i in range(len(ids)):
            try:
                values.append(ids[i].as_py())
            except UnicodeDecodeError:
                values.append(None)
                bad[i] = f"id: the {column!r} value is not valid UTF-8"
        mask = pa.array([i in bad for i in range(len(ids))])
        return pc.if_else(mask, pa.nulls(len(ids), ids.type), ids), values, bad


def row_message(task: ShardTask, row_id: Any, index: int, message: str) -> str:
    """``row id <id> (shard <n>): <message>``, or the row's position when it has no id."""
    where = (f"row id {row_id!r}" if row_id is not None
             else f"row {task.row_start + index} of {task.input_path}")
    return f"{where} (shard {task.shard_id}): {message}"


def _prompt_token_ids(task: ShardTask, table: pa.Table, positions: pa.Array,
                      generated: pa.ChunkedArray) -> pa.ChunkedArray:
    """The ``prompt_token_ids`` column: the engine's (rows that asked for prompt logprobs),
    else the row's input token ids (so a token-id prompt is carried to the output, error rows
    included; an id beyond int32 is left out: that row is an error row anyway)."""
    name = task.columns.get("token_ids")
    if name is None or name not in table.column_names:
        return generated
    given = table.column(name).take(positions)
    try:
        given = given.cast(generated.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        given = pa.array([v if v is None or all(-2**31 <= t < 2**31 for t in v if t is not None)
                          else None for v in given.to_pylist()], generated.type)
    return pc.coalesce(generated, given)


def _valid_text(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A string column with its values that are not valid UTF-8 made null (such a row is an
    error row, which names the prompt; readers would fail on the bytes)."""
    try:
        column.validate(full=True)
        return column
    except pa.ArrowInvalid:
        pass
    values = []
    for chunk in column.chunks:
        for i in range(len(chunk)):
            try:
                values.append(chunk[i].as_py())
            except UnicodeDecodeError:
                values.append(None)
    return pa.chunked_array([pa.array(values, column.type)], column.type)


def _params_column(rows: list[tuple[int, int, Any]], params: dict[int, Any] | None) -> pa.Array:
    """The ``sampling_params`` column: per output row, the params that reproduce it alone
    (n=1, the sample's own seed) as JSON text; null for a row that never ran."""
    values = []
    for i, _, out in rows:
        p = None if params is None else params.get(i)
        seed = getattr(out, "seed", None)
        values.append(None if p is None or seed is None else
                      json.dumps(p.replace(n=1, seed=seed).to_dict(), sort_keys=True))
    return pa.array(values, PARAMS_FIELD.type)


def write_part(task: ShardTask, table: pa.Table, ids: pa.Array,
               rows: list[tuple[int, int, Any]], started: float,
               params: dict[int, Any] | None = None) -> ShardResult:
    """Builds the part table (rows: (input index, sample index, output)) and commits it.
    ``params``: each input row's SamplingParams, for the ``sampling_params`` column."""
    positions = pa.array([r[0] for r in rows], type=pa.int64())
    outputs = [r[2] for r in rows]
    passthrough = table.select([f.name for f in task.schema
                                if f.name not in OUTPUT_COLUMNS and f.name in table.column_names
                                and not (task.write_sampling_params
                                         and f.name == PARAMS_FIELD.name)])
    part = build_table(ids.take(positions), outputs, passthrough.take(positions), task.schema)
    prompt = task.columns.get("prompt")
    if prompt in part.column_names and pa.types.is_string(part.schema.field(prompt).type):
        index = part.schema.get_field_index(prompt)
        part = part.set_column(index, part.schema.field(index), _valid_text(part.column(index)))
    index = part.schema.get_field_index("prompt_token_ids")
    part = part.set_column(index, part.schema.field(index), _prompt_token_ids(
        task, table, positions, part.column(index)))
    if task.write_sampling_params:
        index = part.schema.get_field_index(PARAMS_FIELD.name)
        part = part.set_column(index, PARAMS_FIELD, _params_column(rows, params))
    output_dir = task.output_dir.rstrip("/")
    temp, final = f"{output_dir}/{task.temp_name}", f"{output_dir}/{task.part_name}"
    try:
        pq.write_table(part, temp, filesystem=task.output_fs, **parquet_options(task.schema))
        task.output_fs.move(temp, final)
    except OSError as exc:
        try:  # a half-written temporary helps nobody (a rerun would remove it anyway)
            task.output_fs.delete_file(temp)
        except OSError:
            pass
        raise PartWriteError(f"shard {task.shard_id}: cannot write {final}: {exc}") from exc
    errors = [o.error for o in outputs if getattr(o, "error", None) is not None]
    return ShardResult(
        shard_id=task.shard_id,
        attempt=task.attempt,
        part=task.part_name,
        rows=table.num_rows,
        output_rows=len(outputs),
        errors=len(errors),
        output_tokens=sum(int(o.num_output_tokens or 0) for o in outputs),
        prompt_tokens=sum(int(o.num_prompt_tokens or 0) for o in outputs),
        seconds=time.perf_counter() - started,
        error_messages=errors[:3],
    )


def write_failed_shard(task: ShardTask, message: str) -> ShardResult:
    """Writes every row of the shard as an error row (the shard ran out of attempts)."""
    started = time.perf_counter()
    table = read_rows(task)
    ids, id_values, _ = row_ids(task, table)
    rows = [(i, 0, ErrorOutput(error=row_message(task, row_id, i, message)))
            for i, row_id in enumerate(id_values)]
    return write_part(task, table, ids, rows, started)

