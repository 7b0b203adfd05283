"""The Arrow schema of the output Parquet (docs/design.md, "Output schema") and outputs -> Arrow.

One row per (prompt, sample). The generated columns come first, in the order of the schema
table, then every passthrough input column with its input type.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from actors.engine.generation_output import TopLogprobs, stop_string, stop_token

TOP_LOGPROB = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])

GENERATED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("sample_index", pa.int32()),
    pa.field("output_text", pa.string()),
    pa.field("output_token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
    pa.field("stop_reason", pa.string()),  # the stop string that ended the sample
    pa.field("stop_token_id", pa.int32()),  # the stop token id that did (not an EOS token)
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
    pa.field("sampled_ranks", pa.list_(pa.int32())),
    pa.field("prompt_logprobs", pa.list_(pa.float32())),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("prompt_top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_output_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("error", pa.string()),
)
OUTPUT_COLUMNS: tuple[str, ...] = ("id",) + tuple(f.name for f in GENERATED_FIELDS)
# written when the job asks (``write_sampling_params``): the params that reproduce the row
# alone (JSON text: the row's effective params with n=1 and the sample's own seed)
PARAMS_FIELD = pa.field("sampling_params", pa.string())
# Generated columns written without dictionary encoding: token ids, logprobs, ranks and seeds
# take ~every value once per part, so a dictionary only grows until Parquet gives it up
# (4x the write time of plain encoding for a part with logprobs, and a bigger file). The other
# columns (finish reasons, errors, counts, every passthrough column) keep it.
PLAIN_COLUMNS = frozenset({"output_token_ids", "logprobs", "top_logprobs", "sampled_ranks",
                           "prompt_logprobs", "prompt_token_ids", "prompt_top_logprobs",
                           "seed"})


def output_schema(id_type: pa.DataType = pa.string(), passthrough: pa.Schema | None = None,
                  *, sampling_params: bool = False) -> pa.Schema:
    """The part-file schema: ``id`` (the input id type, or string when ids are generated), the
    generated columns, ``sampling_params`` when asked, then the passthrough columns."""
    fields = [pa.field("id", id_type), *GENERATED_FIELDS]
    if sampling_params:
        fields.append(PARAMS_FIELD)
    if passthrough is not None:
        for f in passthrough:
            if f.name in OUTPUT_COLUMNS or (sampling_params and f.name == PARAMS_FIELD.name):
                raise ValueError(f"input column {f.name!r} collides with the output column of "
                                 "that name; rename it in the input")
            fields.append(f.with_nullable(True))
    return pa.schema(fields)


def leaf_paths(name: str, type_: pa.DataType) -> list[str]:
    """The Parquet column paths of an Arrow field (how ``use_dictionary`` names columns):
    ``a.list.element`` for a list, ``s.x`` for a struct's child, ``m.key_value.key`` and
    ``.value`` for a map."""
    if pa.types.is_map(type_):
        return (leaf_paths(f"{name}.key_value.key", type_.key_type)
                + leaf_paths(f"{name}.key_value.value", type_.item_type))
    if (pa.types.is_list(type_) or pa.types.is_large_list(type_)
            or pa.types.is_fixed_size_list(type_)):
        return leaf_paths(f"{name}.list.element", type_.value_type)
    if pa.types.is_struct(type_):
        return [path for i in range(type_.num_fields)
                for path in leaf_paths(f"{name}.{type_.field(i).name}", type_.field(i).type)]
    return [name]


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """``pyarrow.parquet.write_table`` options for a part of ``schema``: dictionary encoding
    for every column but :data:`PLAIN_COLUMNS`."""
    return {"use_dictionary": [path for f in schema if f.name not in PLAIN_COLUMNS
                               for path in leaf_paths(f.name, f.type)]}


def _as_list(value: Any) -> list | None:
    if value is None:
        return None
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


def _top_entries(step: Any) -> list[dict[str, Any]]:
    """One step's top-k as [{token_id, logprob}], from a mapping, (id, value) pairs, dicts or
    objects with ``token_id``/``logprob`` attributes."""
    if isinstance(step, Mapping):
        return [{"token_id": int(k), "logprob": float(v)} for k, v in step.items()]
    out = []
    for entry in step:
        if isinstance(entry, Mapping):
            out.append({"token_id": int(entry["token_id"]), "logprob": float(entry["logprob"])})
        elif hasattr(entry, "token_id"):
            out.append({"token_id": int(entry.token_id), "logprob": float(entry.logprob)})
        else:
            token_id, logprob = entry
            out.append({"token_id": int(token_id), "logprob": float(logprob)})
    return out


def _top_logprobs_array(values: Sequence[Any]) -> pa.Array:
    """The ``top_logprobs`` column (list<list<struct>>) built from flat id / value arrays and
    offsets. The engine's :class:`~actors.engine.generation_output.TopLogprobs` is read as arrays; steps as
    lists of ``{token_id, logprob}`` dicts without a per-entry conversion; any other form goes
    through :func:`_top_entries`."""
    ids: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    step_lengths: list[np.ndarray] = []
    row_steps = []
    nulls = []
    for value in values:
        nulls.append(value is None)
        if value is None:
            row_steps.append(0)
        elif isinstance(value, TopLogprobs):
            steps, k = value.token_ids.shape
            ids.append(value.token_ids.reshape(-1))
            logprobs.append(value.logprobs.reshape(-1))
            step_lengths.append(np.full(steps, k, np.int64))
            row_steps.append(steps)
        else:
            flat_ids: list[int] = []
            flat_values: list[float] = []
            lengths = []
            for step in value:
                if type(step) is not list or (step and type(step[0]) is not dict):
                    step = _top_entries(step)
                flat_ids.extend([e["token_id"] for e in step])
                flat_values.extend([e["logprob"] for e in step])
                lengths.append(len(step))
            ids.append(np.asarray(flat_ids, np.int64))
            logprobs.append(np.asarray(flat_values, np.float64))
            step_lengths.append(np.asarray(lengths, np.int64))
            row_steps.append(len(lengths))

    def joined(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    step_offsets = np.concatenate([[0], np.cumsum(joined(step_lengths, np.int64))])
    row_offsets = np.concatenate([[0], np.cumsum(np.asarray(row_steps, np.int64))])
    entries = pa.StructArray.from_arrays(
        [pa.array(joined(ids, np.int32)), pa.array(joined(logprobs, np.float32))],
        fields=list(TOP_LOGPROB))
    steps = pa.ListArray.from_arrays(pa.array(step_offsets.astype(np.int32)), entries)
    return pa.ListArray.from_arrays(pa.array(row_offsets.astype(np.int32)), steps,
                                    mask=pa.array(nulls) if any(nulls) else None)


_COLUMN = {  # whole-column builders (the bulk of a part with logprobs: no per-entry dicts)
    "top_logprobs": _top_logprobs_array,
}
_CONVERT = {  # per-value converters before pa.array
    "output_token_ids": _as_list,
    "logprobs": _as_list,
    "sampled_ranks": _as_list,
    "prompt_logprobs": _as_list,
    "prompt_token_ids": _as_list,
    "stop_reason": stop_string,
}
_SOURCE = {"stop_token_id": ("stop_reason", stop_token)}  # columns derived from another one


def generated_columns(outputs: Sequence[Any]) -> dict[str, pa.Array]:
    """The generated columns of ``outputs`` (objects with the schema's attributes, e.g.
    ``GenerationOutput``), typed as in the schema. ``id`` is not included."""
    columns: dict[str, pa.Array] = {}
    for f in GENERATED_FIELDS:
        source, derive = _SOURCE.get(f.name, (f.name, None))
        values = [getattr(o, source, None) for o in outputs]
        if derive is not None:
            values = [derive(v) for v in values]
        build = _COLUMN.get(f.name)
        if build is not None:
            columns[f.name] = build(values).cast(f.type)
            continue
        convert = _CONVERT.get(f.name)
        if convert is not None:
            values = [convert(v) for v in values]
        columns[f.name] = pa.array(values, type=f.type)
    return columns


def build_table(ids: pa.Array, outputs: Sequence[Any], passthrough: pa.Table | None,
                schema: pa.Schema) -> pa.Table:
    """Assembles a part table: ``ids`` and ``passthrough`` hold one entry per output row."""
    columns = {"id": ids, **generated_columns(outputs)}
    arrays = []
    for f in schema:
        if f.name in columns:
            arrays.append(columns[f.name].cast(f.type))
        elif passthrough is not None and f.name in passthrough.column_names:
            arrays.append(passthrough.column(f.name).cast(f.type))
        else:  # a passthrough column this input file does not have
            arrays.append(pa.nulls(len(outputs), f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
