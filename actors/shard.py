"""One shard of a job inside an actor: read its rows, build requests (``actors.rows``), run
them, write the part.

The part file is written under a hidden temporary name (``.part-<shard>-<attempt>.parquet.tmp``)
and renamed to ``part-<shard>.parquet``; the driver then records the commit. A row that cannot
become a request (bad params, no prompt, null id) and a request the engine rejects both become
error rows naming the field, the row id and the shard; the shard goes on.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actors import profiling
from actors.rows import ErrorOutput, Request, prepare_requests, read_rows, row_ids, row_message
from actors.schema import OUTPUT_COLUMNS, PARAMS_FIELD, build_table, parquet_options
from actors.task import ShardTask

__all__ = ["ErrorOutput", "PartWriteError", "PreparedShard", "ShardPrefetch", "ShardResult",
           "ShardTask", "prepare_requests", "prepare_shard", "process_shard", "read_rows",
           "warm_up_io", "write_failed_shard", "write_part"]

RunRequests = Callable[[Sequence[Request]], Sequence[Any]]


class PartWriteError(OSError):
    """The part file could not be written or renamed (the output storage failed)."""


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
    phases: dict[str, float] = field(default_factory=dict)  # seconds: prepare, generate, write
    engine: dict[str, float] = field(default_factory=dict)  # EngineServer.run's stats

    def timing(self) -> str:
        """Where the shard's time went on the actor, for the driver's log: ``prepare 0.08 s,
        generate 3.67 s (queued 1.80 s; 130 steps of 250 sequences in 1.85 s: 14.2 ms a step,
        host 6.1 (on a CPU 5.2), waiting for the device 8.1), write 0.44 s``: the steps' mean
        batch (how full the engine was), host time the stepping thread's wall time outside
        device waits, "on a CPU" the part of it the thread was running."""
        parts = []
        for name, seconds in self.phases.items():
            text = f"{name} {seconds:.2f} s"
            if name == "generate" and self.engine.get("steps"):
                e = self.engine
                per = 1e3 / e["steps"]
                cpu = f" (on a CPU {e['cpu_s'] * per:.1f})" if "cpu_s" in e else ""
                batch = f" of {e['seqs'] / e['steps']:.0f} sequences" if "seqs" in e else ""
                text += (f" (queued {e['queued_s']:.2f} s; {e['steps']} steps{batch} in "
                         f"{e['run_s']:.2f} s: {e['run_s'] * per:.1f} ms a step, host "
                         f"{(e['busy_s'] - e['device_wait_s']) * per:.1f}{cpu}, waiting for "
                         f"the device {e['device_wait_s'] * per:.1f})")
            parts.append(text)
        return ", ".join(parts)


class _Relabelled:
    """An engine output seen with its error message prefixed by the row id and shard."""

    def __init__(self, output: Any, error: str | None) -> None:
        self._output, self.error = output, error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._output, name)


@dataclass(slots=True)
class PreparedShard:
    """A shard's rows read and turned into requests (``prepare_shard``); ``built``: the
    engine's ``build_requests`` of them, when made ahead (``ShardPrefetch``)."""

    table: pa.Table
    ids: pa.Array
    id_values: list
    requests: list[Request]
    failed: dict[int, Any]
    seconds: float
    built: Any = None


def prepare_shard(task: ShardTask) -> PreparedShard:
    """Reads the shard's rows and makes its requests (bad rows become error outputs)."""
    started = time.perf_counter()
    table = read_rows(task)
    ids, id_values, id_errors = row_ids(task, table)
    requests, failed = prepare_requests(task, table, id_values, id_errors)
    return PreparedShard(table, ids, id_values, requests, failed,
                         time.perf_counter() - started)


def process_shard(task: ShardTask, run: RunRequests,
                  prepared: PreparedShard | None = None) -> ShardResult:
    """Reads the shard, runs its requests through ``run`` (blocking: requests -> finished
    outputs, e.g. ``EngineServer.run`` or ``Engine.generate``; given ``prepared.built`` too, as
    ``built=``, when they were built ahead) and commits the part file. ``prepared``: the shard
    already read (``ShardPrefetch``); its reading time is then reported as the ``prefetch``
    phase, apart from this call's."""
    started, wall = time.perf_counter(), time.time()
    phases: dict[str, float] = {}
    if prepared is None:
        prepared = prepare_shard(task)
        profiling.span("prepare", wall, task.shard_id)
    else:
        phases["prefetch"] = prepared.seconds
    table, ids, id_values = prepared.table, prepared.ids, prepared.id_values
    prepared_at = time.perf_counter()
    rows: list[tuple[int, int, Any]] = [(i, 0, out) for i, out in prepared.failed.items()]
    if not prepared.requests:
        outputs = ()
    elif prepared.built is not None:
        outputs = run(prepared.requests, built=prepared.built)
    else:
        outputs = run(prepared.requests)
    for out in outputs:
        i = int(str(out.id).rsplit(".", 1)[1])
        error = getattr(out, "error", None)
        if error is not None:
            out = _Relabelled(out, row_message(task, id_values[i], i, str(error)))
        rows.append((i, int(out.sample_index), out))
    rows.sort(key=lambda r: (r[0], r[1]))
    generated, wall = time.perf_counter(), time.time()
    params = {int(rid.rsplit(".", 1)[1]): p for rid, _, p in prepared.requests} \
        if task.write_sampling_params else None
    result = write_part(task, table, ids, rows, started, params)
    profiling.span("write", wall, task.shard_id)
    if profiling.trace is not None:
        profiling.trace.dump()
    phases.update(prepare=prepared_at - started, generate=generated - prepared_at,
                  write=time.perf_counter() - generated)
    result.phases = phases
    return result


class ShardPrefetch:
    """Prepares an actor's first shard while its model loads: a thread reads the rows and
    makes the requests at once (no engine needed), and builds them (``Engine.build_requests``:
    validation and tokenization) once ``engine_ready`` hands it the engine. ``take`` gives the
    result to the ``process_shard`` call of that shard and attempt (waiting for the thread
    if it is still at work), or None: for another shard, after ``cancel``, or when the
    prefetch raised (the call then reads the shard itself and meets the same error there)."""

    def __init__(self, task: ShardTask) -> None:
        self.key = (task.shard_id, task.attempt)
        self._engine: Any = None
        self._engine_known = threading.Event()
        self._result: PreparedShard | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(task,), daemon=True,
                                        name="shard-prefetch")
        self._thread.start()

    def _run(self, task: ShardTask) -> None:
        try:
            wall = time.time()
            prepared = prepare_shard(task)
            profiling.span("prefetch", wall, task.shard_id)
            self._engine_known.wait()
            if getattr(self._engine, "build_requests", None) is not None and prepared.requests:
                started, wall = time.perf_counter(), time.time()
                prepared.built = self._engine.build_requests(prepared.requests)
                prepared.seconds += time.perf_counter() - started
                profiling.span("build", wall, task.shard_id)
            self._result = prepared
        except BaseException as exc:  # noqa: BLE001 - the shard's own call meets it again
            self.error = exc

    def engine_ready(self, engine: Any) -> None:
        """The engine to build the requests with (None: read only, never build)."""
        self._engine = engine
        self._engine_known.set()

    def cancel(self) -> None:
        """Lets the thread end without building (the engine could not be made)."""
        self.engine_ready(None)

    def take(self, task: ShardTask) -> PreparedShard | None:
        if (task.shard_id, task.attempt) != self.key:
            return None
        self._thread.join()
        result, self._result = self._result, None
        return result


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


def warm_up_io() -> float:
    """Pays the shard I/O path's one-time costs now (an actor calls it before it reports
    ready), so that its first shard does not: pyarrow's first conversion of Python values
    (which imports pandas where that is installed) and the Parquet writer's and reader's first
    use, ~0.2 s together, otherwise spent inside the job on a thread that shares the GIL with
    the engine loop. Returns the seconds it took."""
    started = time.perf_counter()
    table = pa.table({
        "id": pa.array(["warm-up"]),
        "output_token_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
        "top_logprobs": pa.array([[[{"token_id": 1, "logprob": -0.5}]]]),
    })
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **parquet_options(table.schema))
    back = pq.read_table(pa.BufferReader(sink.getvalue()))
    if back.num_rows != 1:
        raise RuntimeError("the Parquet warm-up read back a wrong table")
    return time.perf_counter() - started


def write_failed_shard(task: ShardTask, message: str) -> ShardResult:
    """Writes every row of the shard as an error row (the shard ran out of attempts)."""
    started = time.perf_counter()
    table = read_rows(task)
    ids, id_values, _ = row_ids(task, table)
    rows = [(i, 0, ErrorOutput(error=row_message(task, row_id, i, message)))
            for i, row_id in enumerate(id_values)]
    return write_part(task, table, ids, rows, started)
