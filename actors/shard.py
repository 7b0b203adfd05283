"""One shard of a job inside an actor: read its rows, build requests, run them, write the part.

The part file is written under a hidden temporary name (``.part-<shard>-<attempt>.parquet.tmp``)
and renamed to ``part-<shard>.parquet``; the driver then records the commit. A row that cannot
become a request (bad params, no prompt, null id) and a request the engine rejects both become
error rows naming the field, the row id and the shard; the shard goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from actors.schema import OUTPUT_COLUMNS, build_table
from sampler.params import SamplingParams

Request = tuple[str, Any, SamplingParams]
RunRequests = Callable[[Sequence[Request]], Sequence[Any]]


class PartWriteError(OSError):
    """The part file could not be written or renamed (the output storage failed)."""


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

    @property
    def part_name(self) -> str:
        return f"part-{self.shard_id:05d}.parquet"

    @property
    def temp_name(self) -> str:
        return f".part-{self.shard_id:05d}-{self.attempt}.parquet.tmp"


@dataclass(slots=True)
class ShardResult:
    """What an actor reports for a written shard (the rows stay in the part file)."""

    shard_id: int
    attempt: int
    part: str
    rows: int
    output_rows: int
    errors: int
    output_tokens: int
    prompt_tokens: int
    seconds: float
    error_messages: list[str] = field(default_factory=list)  # the first few, for logs


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
    dataset = ds.dataset(task.input_path, format=task.input_format, filesystem=task.input_fs)
    start, stop = task.row_start, task.row_stop
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
    table = pa.concat_tables(pieces) if pieces else dataset.schema.empty_table()
    if table.num_rows != stop - start:
        raise ValueError(f"shard {task.shard_id}: {task.input_path} has fewer rows than planned "
                         f"(wanted rows {start}..{stop}); the input changed during the job")
    return table


def _row_ids(task: ShardTask, table: pa.Table) -> pa.Array:
    column = task.columns.get("id")
    if task.id_offset is None and column is not None:
        return table.column(column).combine_chunks().cast(task.schema.field("id").type)
    base = (task.id_offset or 0) + task.row_start
    return pa.array([str(base + i) for i in range(table.num_rows)], type=pa.string())


def _prompt(task: ShardTask, table: pa.Table, i: int) -> Any:
    for role in ("prompt", "messages", "token_ids"):
        name = task.columns.get(role)
        if name is None or name not in table.column_names:
            continue
        value = table.column(name)[i].as_py()
        if value is None:
            continue
        if role == "messages":
            return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                    for m in value]
        return value
    names = ", ".join(repr(task.columns[r]) for r in ("prompt", "messages", "token_ids")
                      if r in task.columns)
    raise ValueError(f"no prompt: {names} all null")


def prepare_requests(task: ShardTask, table: pa.Table, ids: list[Any]
                     ) -> tuple[list[Request], dict[int, ErrorOutput]]:
    """Requests for the rows that can run; an ``ErrorOutput`` for each row that cannot."""
    params_column = task.columns.get("params")
    has_params = params_column is not None and params_column in table.column_names
    requests: list[Request] = []
    errors: dict[int, ErrorOutput] = {}
    for i, row_id in enumerate(ids):
        try:
            if row_id is None:
                raise ValueError(f"id: the {task.columns.get('id', 'id')!r} column is null")
            raw = table.column(params_column)[i].as_py() if has_params else None
            params = SamplingParams.coerce(_arrow_params(raw), defaults=task.default_params)
            if params.seed is None:  # the job's seed rule for unseeded rows
                from sampler import derive_seed

                params = params.replace(seed=derive_seed(task.seed, row_id))
            prompt = _prompt(task, table, i)
        except (ValueError, TypeError) as exc:
            errors[i] = ErrorOutput(error=_row_message(task, row_id, i, str(exc)))
            continue
        requests.append((f"{task.shard_id}.{task.attempt}.{i}", prompt, params))
    return requests, errors


def _arrow_params(raw: Any) -> Any:
    """Undoes what Arrow does to a ``logit_bias`` mapping: a map column reads back as (key,
    value) pairs, a struct column has a null for every key another row set."""
    if isinstance(raw, dict) and raw.get("logit_bias") is not None:
        bias = raw["logit_bias"]
        if isinstance(bias, list) and all(isinstance(p, tuple) and len(p) == 2 for p in bias):
            bias = dict(bias)
        if isinstance(bias, dict):
            bias = {k: v for k, v in bias.items() if v is not None}
        raw = {**raw, "logit_bias": bias}
    return raw


def _row_message(task: ShardTask, row_id: Any, index: int, message: str) -> str:
    where = (f"row id {row_id!r}" if row_id is not None
             else f"row {task.row_start + index} of {task.input_path}")
    return f"{where} (shard {task.shard_id}): {message}"


class _Relabelled:
    """An engine output seen with its error message prefixed by the row id and shard."""

    def __init__(self, output: Any, error: str | None) -> None:
        self._output, self.error = output, error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._output, name)


def process_shard(task: ShardTask, run: RunRequests) -> ShardResult:
    """Reads the shard, runs its requests through ``run`` (blocking: requests -> finished
    outputs, e.g. ``EngineServer.run`` or ``Engine.generate``) and commits the part file."""
    started = time.perf_counter()
    table = read_rows(task)
    ids = _row_ids(task, table)
    id_values = ids.to_pylist()
    requests, failed = prepare_requests(task, table, id_values)
    rows: list[tuple[int, int, Any]] = [(i, 0, out) for i, out in failed.items()]
    for out in run(requests) if requests else ():
        i = int(str(out.id).rsplit(".", 1)[1])
        error = getattr(out, "error", None)
        if error is not None:
            out = _Relabelled(out, _row_message(task, id_values[i], i, str(error)))
        rows.append((i, int(out.sample_index), out))
    rows.sort(key=lambda r: (r[0], r[1]))
    return write_part(task, table, ids, rows, started)


def write_part(task: ShardTask, table: pa.Table, ids: pa.Array,
               rows: list[tuple[int, int, Any]], started: float) -> ShardResult:
    """Builds the part table (rows: (input index, sample index, output)) and commits it."""
    positions = pa.array([r[0] for r in rows], type=pa.int64())
    outputs = [r[2] for r in rows]
    passthrough = table.select([f.name for f in task.schema
                                if f.name not in OUTPUT_COLUMNS and f.name in table.column_names])
    part = build_table(ids.take(positions), outputs, passthrough.take(positions), task.schema)
    output_dir = task.output_dir.rstrip("/")
    temp, final = f"{output_dir}/{task.temp_name}", f"{output_dir}/{task.part_name}"
    try:
        pq.write_table(part, temp, filesystem=task.output_fs)
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
    ids = _row_ids(task, table)
    rows = [(i, 0, ErrorOutput(error=_row_message(task, row_id, i, message)))
            for i, row_id in enumerate(ids.to_pylist())]
    return write_part(task, table, ids, rows, started)
