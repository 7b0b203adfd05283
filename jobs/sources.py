"""Input discovery and validation: files, formats, row counts, columns, the output schema.

Runs on the driver before any actor starts. Every problem raises one ``ValueError`` naming the
input, the file and the column.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds

from actors.contract import jsonl, openai_batch
from actors.contract.schema import OUTPUT_COLUMNS, output_schema
from jobs.config import JobConfig
from jobs.storage import Location, list_files, resolve

FORMATS = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc",
    ".jsonl": "json", ".ndjson": "json", ".json": "json",
}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")


@dataclass(frozen=True, slots=True)
class InputFile:
    """One input file: where it is, how to read it, how many rows it has."""

    location: Location
    format: str
    rows: int
    size: int
    row_offset: int  # global index of its first row (for generated ids)

    @property
    def path(self) -> str:
        return self.location.path


@dataclass(frozen=True, slots=True)
class InputSpec:
    """The job's input: its files and the schema its part files will have."""

    files: list[InputFile]
    columns: dict[str, str]  # role -> column name, for the roles present in some file
    schema: pa.Schema  # output schema (id, generated columns, passthrough)
    generated_ids: bool

    @property
    def total_rows(self) -> int:
        return sum(f.rows for f in self.files)


def file_format(path: str) -> str | None:
    """parquet | ipc | json from the file name, or None when the extension is not known."""
    name = path.lower()
    for ext in _COMPRESSED:
        if name.endswith(ext) and any(name[: -len(ext)].endswith(e) for e in (".jsonl", ".json",
                                                                               ".ndjson")):
            return "json"
    for ext, fmt in FORMATS.items():
        if name.endswith(ext):
            return fmt
    return None


def _files(config: JobConfig) -> list[tuple[Location, str]]:
    out: list[tuple[Location, str]] = []
    for spelled in config.inputs:
        loc = resolve(spelled)
        paths = list_files(loc)
        known = [(p, file_format(p)) for p in paths]
        explicit = len(paths) == 1 and paths[0] == loc.path
        for path, fmt in known:
            if fmt is None and explicit:
                raise ValueError(f"input: {spelled!r} is not a known format (extensions: "
                                 f"{', '.join(sorted(FORMATS))}, JSONL optionally compressed)")
        found = [(Location(loc.fs, p, p), f) for p, f in known if f is not None]
        if not found:
            raise ValueError(f"input: {spelled!r} matches no Parquet, Arrow or JSONL file")
        out.extend(found)
    return out


def _check_type(role: str, name: str, typ: pa.DataType, path: str) -> None:
    def is_list_of(pred) -> bool:  # list<null>: JSON lists that are all empty
        return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and (
            pred(typ.value_type) or pa.types.is_null(typ.value_type))

    ok = pa.types.is_null(typ) or {
        "prompt": lambda: pa.types.is_string(typ) or pa.types.is_large_string(typ),
        "messages": lambda: is_list_of(pa.types.is_struct),
        "token_ids": lambda: is_list_of(pa.types.is_integer),
        "params": lambda: (pa.types.is_struct(typ) or pa.types.is_string(typ)
                           or pa.types.is_large_string(typ)),
        "id": lambda: (pa.types.is_integer(typ) or pa.types.is_string(typ)
                       or pa.types.is_large_string(typ)),
    }[role]()
    if not ok:
        expected = {"prompt": "string", "messages": "list<struct<role, content>>",
                    "token_ids": "list<int>", "params": "struct or JSON string",
                    "id": "integer or string"}[role]
        raise ValueError(f"input: column {name!r} of {path} must be {expected}, got {typ}")


def _open(path_loc: Location, fmt: str) -> ds.Dataset:
    try:
        return ds.dataset(path_loc.path, format=fmt, filesystem=path_loc.fs)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"input: cannot read {path_loc.path}: {exc}") from None


def _read_schema(loc: Location, fmt: str, params_column: str) -> tuple[str, pa.Schema, int]:
    """(format, schema, row count) of one file. A JSONL file whose rows pyarrow cannot type
    as one table is read line by line instead (``actors.contract.jsonl``)."""
    try:
        dataset = _open(loc, fmt)
        return fmt, dataset.schema, dataset.count_rows()
    except (ValueError, OSError, pa.ArrowException) as exc:
        if fmt != "json":
            raise ValueError(f"input: cannot read {loc.path}: {exc}") from None
        first = str(exc)
    try:
        schema, rows = jsonl.scan(loc.fs, loc.path, params_column)
    except (ValueError, OSError) as exc:
        if " line " in str(exc):  # it names the line: pyarrow's may be about another row
            raise ValueError(str(exc)) from None
        raise ValueError(f"{exc} (pyarrow: {first.splitlines()[-1]})") from None
    return jsonl.FORMAT, schema, rows


def _scan_batch(loc: Location, roles: dict[str, str]) -> tuple[pa.Schema, int]:
    try:
        return openai_batch.scan(loc.fs, loc.path, roles)
    except (OSError, ValueError) as exc:
        raise ValueError(f"input: cannot read {loc.path}: {exc}") from None


def discover(config: JobConfig) -> InputSpec:
    """Lists, opens and checks every input file; builds the output schema."""
    roles = {"id": config.id_column, "prompt": config.prompt_column,
             "messages": config.messages_column, "token_ids": config.token_ids_column,
             "params": config.params_column}
    # the prompt text and chat messages pass through as given; token ids come out as the
    # generated prompt_token_ids column, params as the optional sampling_params one
    consumed = {roles["id"], roles["token_ids"], roles["params"]}
    batch = config.input_format == "openai_batch"
    if batch:  # a line's error goes to the error column
        consumed.add(openai_batch.ERROR_COLUMN)
    files: list[InputFile] = []
    schemas: list[pa.Schema] = []
    id_types: list[pa.DataType] = []
    id_files: list[bool] = []
    present: dict[str, str] = {}
    offset = 0
    for loc, fmt in _files(config):
        if batch:
            fmt = openai_batch.FORMAT
            schema, rows = _scan_batch(loc, roles)
            present["error"] = openai_batch.ERROR_COLUMN
        else:
            fmt, schema, rows = _read_schema(loc, fmt, config.params_column)
        for role, name in roles.items():
            if name in schema.names:
                _check_type(role, name, schema.field(name).type, loc.path)
                present[role] = name
        if not any(roles[r] in schema.names for r in ("prompt", "messages", "token_ids")):
            raise ValueError(
                f"input: {loc.path} has none of the prompt columns {config.prompt_column!r}, "
                f"{config.messages_column!r}, {config.token_ids_column!r} (columns: "
                f"{', '.join(schema.names)})")
        id_files.append(config.id_column in schema.names)
        if id_files[-1]:
            id_types.append(schema.field(config.id_column).type)
        schemas.append(pa.schema([f for f in schema if f.name not in consumed]))
        size = loc.fs.get_file_info(loc.path).size or 0
        files.append(InputFile(loc, fmt, rows, size, offset))
        offset += rows
    if any(id_files) and not all(id_files):
        missing = [f.path for f, has in zip(files, id_files) if not has]
        raise ValueError(f"input: id column {config.id_column!r} is missing from "
                         f"{', '.join(missing[:3])} but present in other input files")
    if offset == 0:
        raise ValueError(f"input: {config.input!r} has no rows")
    try:
        passthrough = pa.unify_schemas(schemas, promote_options="permissive")
        id_type = _unify_id(id_types)
    except (pa.ArrowException, ValueError) as exc:
        raise ValueError(f"input: the input files disagree on column types: {exc}") from None
    for name in passthrough.names:
        if name in OUTPUT_COLUMNS:
            raise ValueError(f"input: column {name!r} collides with the output column of that "
                             "name; rename it in the input")
    schema = output_schema(id_type, passthrough, sampling_params=config.write_sampling_params)
    return InputSpec(files, present, schema, not id_types)


def _unify_id(types: list[pa.DataType]) -> pa.DataType:
    if not types:
        return pa.string()
    non_null = [t for t in types if not pa.types.is_null(t)] or [pa.string()]
    return pa.unify_schemas([pa.schema([("id", t)]) for t in non_null],
                            promote_options="permissive").field("id").type
