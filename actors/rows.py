"""A shard's input rows -> engine requests, or error rows naming the field, row id and shard.

Everything a data file can hold is expected here: null ids, null or invalid UTF-8 strings,
params that are garbage, empty or role-less chat messages. Each such row becomes one
:class:`ErrorOutput` whose error starts with ``row id <id> (shard <n>): `` (or the row's
position in its file when the id itself is unusable) and names the field.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from actors.contract.shard_io import ErrorOutput, row_message
from sampler.params import SamplingParams

if TYPE_CHECKING:
    from actors.contract.task import ShardTask

Request = tuple[str, Any, SamplingParams]


def _value(table: pa.Table, column: str, i: int, field_name: str) -> Any:
    try:
        return table.column(column)[i].as_py()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{field_name}: the {column!r} value is not valid UTF-8 ({exc.reason} "
                         f"at byte {exc.start})") from None


class _Cells:
    """Python values of a table's cells, converting a whole column at its first use (one
    C loop instead of a conversion per cell). A column that cannot convert as a whole (a
    string that is not UTF-8, say) converts cell by cell, so only its bad rows fail."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self._columns: dict[str, list[Any] | None] = {}

    def get(self, column: str, i: int, field_name: str) -> Any:
        values = self._columns.get(column, _UNCONVERTED)
        if values is _UNCONVERTED:
            try:
                values = self.table.column(column).to_pylist()
            except Exception:  # noqa: BLE001 - the per-cell path names the row and the field
                values = None
            self._columns[column] = values
        if values is None:
            return _value(self.table, column, i, field_name)
        return values[i]


_UNCONVERTED = object()


def _messages(value: list, column: str) -> list[dict[str, Any]]:
    if not value:
        raise ValueError(f"messages: no messages in the {column!r} column")
    out = []
    for k, message in enumerate(value):
        # a struct column holds a null for every key another row set: null = not set
        message = {key: v for key, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages: message {k} of the {column!r} column has no role")
        if message.get("content") is None:
            raise ValueError(f"messages: message {k} of the {column!r} column has no content")
        out.append(message)
    return out


def _prompt(task: ShardTask, cells: _Cells, i: int) -> Any:
    for role in ("prompt", "messages", "token_ids"):
        name = task.columns.get(role)
        if name is None or name not in cells.table.column_names:
            continue
        value = cells.get(name, i, "messages" if role == "messages" else "prompt")
        if value is None:
            continue
        return _messages(value, name) if role == "messages" else value
    names = ", ".join(repr(task.columns[r]) for r in ("prompt", "messages", "token_ids")
                      if r in task.columns)
    raise ValueError(f"no prompt: {names} all null")


class _ParamsReader:
    """A row's SamplingParams over the job defaults. Rows often repeat their params (none,
    or the same JSON text): those are validated once per shard."""

    def __init__(self, task: ShardTask, cells: _Cells) -> None:
        self.task = task
        column = task.columns.get("params")
        self.column = column if column is not None and column in cells.table.column_names \
            else None
        self.cells = cells
        self._seen: dict[Any, SamplingParams] = {}

    def _coerce(self, raw: Any) -> SamplingParams:
        task = self.task
        params = SamplingParams.coerce(_arrow_params(raw), defaults=task.default_params)
        if task.max_num_seqs is not None and params.n > task.max_num_seqs:
            # refused here: the engine would first make one error row per asked-for sample
            raise ValueError(f"sampling_params.n: must be <= max_num_seqs "
                             f"({task.max_num_seqs}), got {params.n}")
        return params

    def read(self, i: int, row_id: Any) -> SamplingParams:
        raw = None if self.column is None else self.cells.get(self.column, i, "sampling_params")
        seed, rest = None, raw
        if isinstance(raw, dict) and raw.get("seed") is not None:
            # a per-row seed: the rest of the row's params is validated once, the seed alone
            seed = raw["seed"]
            rest = {k: v for k, v in raw.items() if k != "seed"}
        try:
            key = _frozen(rest)
            params = None if key is None else self._seen.get(key)
            if params is None:
                params = self._coerce(rest)
                if key is not None:
                    self._seen[key] = params
            if seed is not None:
                params = params.with_seed(seed)
        except ValueError:
            if seed is None:
                raise
            # a row with a bad seed and another bad field: name the field that validating
            # the whole row names first, as for the same params given as JSON text
            self._coerce(raw)
            raise
        if params.seed is None:  # the job's seed rule for unseeded rows
            from sampler import derive_seed

            params = params.with_seed(derive_seed(self.task.seed, row_id))
        return params


def _frozen(value: Any) -> Any:
    """A hashable form of a params cell (None, JSON text, or a struct row as dicts and lists
    of plain values), or None when it has none. Equal forms validate to equal params."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return (type(value).__name__, value)
    if isinstance(value, dict):
        items = tuple((k, _frozen(v)) for k, v in value.items())
        return None if any(v is None for _, v in items) else ("dict", items)
    if isinstance(value, (list, tuple)):
        items = tuple(_frozen(v) for v in value)
        return None if any(v is None for v in items) else (type(value).__name__, items)
    return None


def prepare_requests(task: ShardTask, table: pa.Table, ids: list[Any],
                     id_errors: dict[int, str] | None = None
                     ) -> tuple[list[Request], dict[int, ErrorOutput]]:
    """Requests for the rows that can run; an ``ErrorOutput`` for each row that cannot."""
    requests: list[Request] = []
    errors: dict[int, ErrorOutput] = {}
    cells = _Cells(table)
    params_of = _ParamsReader(task, cells)
    given_error = task.columns.get("error")  # a line the reader could not make a row of
    if given_error not in table.column_names:
        given_error = None
    for i, row_id in enumerate(ids):
        try:
            if id_errors and i in id_errors:
                raise ValueError(id_errors[i])
            if given_error is not None and cells.get(given_error, i, "line") is not None:
                raise ValueError(cells.get(given_error, i, "line"))
            if row_id is None:
                raise ValueError(f"id: the {task.columns.get('id', 'id')!r} column is null")
            params = params_of.read(i, row_id)
            prompt = _prompt(task, cells, i)
        except (ValueError, TypeError) as exc:
            errors[i] = ErrorOutput(error=row_message(task, row_id, i, str(exc)))
            continue
        requests.append((f"{task.shard_id}.{task.attempt}.{i}", prompt, params))
    return requests, errors


def _arrow_params(raw: Any) -> Any:
    """A params value as SamplingParams should see it. A null field means "not set", as in
    a struct column, which has a null for every key another row set (so another row's
    unknown key does not fail this one); the same holds for JSON text, so a row reads the
    same from a struct or a JSON column. A ``logit_bias`` map column reads back as (key,
    value) pairs, and a struct one with nulls too."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return raw  # SamplingParams names the JSON error
        if not isinstance(parsed, dict):
            return raw
        raw = parsed
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if v is not None}
    if isinstance(raw, dict) and raw.get("logit_bias") is not None:
        bias = raw["logit_bias"]
        if isinstance(bias, list) and all(isinstance(p, tuple) and len(p) == 2 for p in bias):
            bias = dict(bias)
        if isinstance(bias, dict):
            bias = {k: v for k, v in bias.items() if v is not None}
        raw = {**raw, "logit_bias": bias}
    return raw


