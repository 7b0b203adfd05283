"""One shard of a job inside an actor: read its rows (``actors.contract.shard_io``), build
requests (``actors.rows``), run them, write the part.

A row that cannot
become a request (bad params, no prompt, null id) and a request the engine rejects both become
error rows naming the field, the row id and the shard; the shard goes on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from actors.contract.schema import parquet_options
from actors.contract.shard_io import (
    ErrorOutput,
    read_rows,
    row_ids,
    row_message,
    write_failed_shard,
    write_part,
)
from actors.contract.task import PartWriteError, ShardResult, ShardTask
from actors.engine import profiling
from actors.rows import Request, prepare_requests

__all__ = ["ErrorOutput", "PartWriteError", "PreparedShard", "ShardPrefetch", "ShardResult",
           "ShardTask", "prepare_requests", "prepare_shard", "process_shard", "read_rows",
           "warm_up_io", "write_failed_shard", "write_part"]

RunRequests = Callable[[Sequence[Request]], Sequence[Any]]


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


