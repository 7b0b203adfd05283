"""JSONL files whose rows disagree on types: read line by line, params kept as JSON text.

pyarrow's JSON reader gives each column one type for the whole file and refuses the file
when rows disagree: typical for per-row sampling params (``{"stop": "x"}`` in one row,
``{"stop": ["x"]}`` in another, or a value of the wrong type). Such a file is read here
instead: each line is parsed with ``json``, the params column is turned back into JSON text
(a string column), and SamplingParams parses that text per row, so a bad value fails its row
only. Files pyarrow reads are not affected. A line that is not a JSON object, or another
column whose lines hold different JSON types (``"messages": "hi"`` among lists), makes the
file unreadable, with one message naming the column and the lines that disagree.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

FORMAT = "jsonl-text-params"  # the format name a plan records for such a file
_CHUNK = 4096  # lines per Arrow conversion


def lines(fs: pafs.FileSystem, path: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of the non-blank lines."""
    with fs.open_input_stream(path, compression="detect") as stream:
        rest, number = b"", 0
        while True:
            block = stream.read(1 << 20)
            *lines, rest = (rest + block).split(b"\n") if block else (rest, b"")
            for line in lines:
                number += 1
                if line.strip():
                    try:
                        yield number, line.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"input: {path} line {number} is not valid "
                                         "UTF-8") from None
            if not block:
                break


def _record(path: str, number: int, text: str, params_column: str | None) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"input: {path} line {number} is not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"input: {path} line {number} is not a JSON object")
    if params_column is not None:
        value = row.get(params_column)
        if value is not None and not isinstance(value, str):
            row[params_column] = json.dumps(value)
    return row


def _table(path: str, rows: list[dict[str, Any]], first_line: int) -> pa.Table:
    names = list(dict.fromkeys(key for row in rows for key in row))  # every row's keys
    try:
        return pa.table({name: [row.get(name) for row in rows] for name in names})
    except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"input: cannot read {path}: the rows from line {first_line} on "
                         f"do not make one table ({exc})") from None


def _kind(value: Any) -> str | None:
    """The JSON type of a value (int and float are both numbers; null has none)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}[type(value)]


class _Kinds:
    """The JSON type each column holds, and the line it was first seen on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: dict[str, tuple[str, int]] = {}

    def check(self, row: dict[str, Any], number: int) -> None:
        for name, value in row.items():
            kind = _kind(value)
            if kind is None:
                continue
            first = self.seen.setdefault(name, (kind, number))
            if first[0] != kind:
                raise ValueError(f"input: {self.path} line {number}: column {name!r} holds "
                                 f"{kind}, but {first[0]} on line {first[1]}; every line must "
                                 "give a column the same type")


def _chunks(fs: pafs.FileSystem, path: str, params_column: str | None, start: int = 0,
            stop: int | None = None) -> Iterator[pa.Table]:
    """Tables of the data rows ``[start, stop)`` (row = non-blank line), a chunk at a time."""
    rows: list[dict[str, Any]] = []
    first = 0
    kinds = _Kinds(path)
    for index, (number, text) in enumerate(lines(fs, path)):
        if stop is not None and index >= stop:
            break
        if index < start:
            continue
        if not rows:
            first = number
        rows.append(_record(path, number, text, params_column))
        kinds.check(rows[-1], number)
        if len(rows) == _CHUNK:
            yield _table(path, rows, first)
            rows = []
    if rows:
        yield _table(path, rows, first)


def scan(fs: pafs.FileSystem, path: str, params_column: str | None) -> tuple[pa.Schema, int]:
    """The file's schema (every chunk's, unified) and row count; ``ValueError`` if it cannot
    be read this way either."""
    schemas, count = [], 0
    for chunk in _chunks(fs, path, params_column):
        schemas.append(chunk.schema)
        count += chunk.num_rows
    if not schemas:
        return pa.schema([]), 0
    try:
        return pa.unify_schemas(schemas, promote_options="permissive"), count
    except (pa.ArrowException, ValueError) as exc:
        raise ValueError(f"input: cannot read {path}: its rows disagree on a column's type "
                         f"({exc})") from None


def read_range(fs: pafs.FileSystem, path: str, params_column: str | None, start: int,
               stop: int, schema: pa.Schema | None = None) -> pa.Table:
    """Rows ``[start, stop)`` as one table (cast to ``schema`` when given)."""
    chunks = list(_chunks(fs, path, params_column, start, stop))
    if schema is None:
        schema = pa.unify_schemas([c.schema for c in chunks], promote_options="permissive") \
            if chunks else pa.schema([])
    return pa.concat_tables([_conform(c, schema) for c in chunks]) if chunks \
        else schema.empty_table()


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)
