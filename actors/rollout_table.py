"""RL rollouts on the actor side: logprob columns with a declared meaning, and the Arrow table
one actor returns (the job output columns plus those columns).

Per sampled token ``t`` of a row with temperature ``T`` (``T = 1`` for greedy rows) and raw
model logits ``z`` (float32):

- ``raw_logprobs``: ``log_softmax(z)[t]``, what a trainer's plain forward computes;
- ``temperature_logprobs``: ``log_softmax(z / T)[t]``, what a trainer that applies the
  rollout temperature computes (the probability the token was drawn with when no top-k /
  top-p / min-p / penalties apply);
- ``processed_logprobs``: ``log_softmax`` of the logits after every sampling step (penalties,
  masks, temperature, min-p, top-k, top-p; renormalised over the kept tokens), i.e. the log
  probability of the draw itself. It is the row's own ``logprobs`` column in the
  ``processed_logprobs`` mode, so a row asking for it must use that mode or none.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import pyarrow as pa

from actors.contract.schema import generated_columns, output_schema
from sampler.params import SamplingParams

LOGPROB_COLUMNS: tuple[str, ...] = ("raw_logprobs", "temperature_logprobs",
                                    "processed_logprobs")
_SHORT = {"raw": "raw_logprobs", "temperature": "temperature_logprobs",
          "processed": "processed_logprobs"}


def canonical_columns(columns: Iterable[str] | None) -> tuple[str, ...]:
    """Validated column names, in the order of ``LOGPROB_COLUMNS`` ("raw", "temperature" and
    "processed" are accepted for the full names)."""
    if columns is None:
        return ()
    if isinstance(columns, str):
        columns = [columns]
    names = set()
    for name in columns:
        full = _SHORT.get(name, name)
        if full not in LOGPROB_COLUMNS:
            raise ValueError(f"logprob_columns: unknown column {name!r} (known: "
                             f"{', '.join(LOGPROB_COLUMNS)})")
        names.add(full)
    return tuple(c for c in LOGPROB_COLUMNS if c in names)


def prepare_params(params: Sequence[Any], columns: tuple[str, ...]) -> list[SamplingParams]:
    """Each prompt's params as ``SamplingParams``; with the processed column, rows that did
    not ask for logprobs get ``logprobs=0`` in the processed mode.

    Raises:
        ValueError: invalid params, or a row asking for logprobs in another mode than
            ``processed_logprobs`` while the processed column is wanted (the message names the
            prompt's position).
    """
    out = []
    for i, p in enumerate(params):
        try:
            sp = SamplingParams.coerce(p)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"params[{i}]: {exc}") from None
        if "processed_logprobs" in columns:
            if sp.logprobs is None:
                sp = sp.replace(logprobs=0, logprobs_mode="processed_logprobs")
            elif sp.logprobs_mode != "processed_logprobs":
                raise ValueError(
                    f"params[{i}]: logprob_columns has 'processed_logprobs', which is the "
                    f"row's own logprobs in that mode, but the row asks for logprobs_mode="
                    f"{sp.logprobs_mode!r}; use processed_logprobs or leave logprobs unset")
        out.append(sp)
    return out


def rollout_schema(id_type: pa.DataType, columns: tuple[str, ...]) -> pa.Schema:
    """The job output schema with ``id_type`` ids, then the requested logprob columns."""
    schema = output_schema(id_type)
    for name in columns:
        schema = schema.append(pa.field(name, pa.list_(pa.float32())))
    return schema


def rollout_table(outputs: Sequence[Any], ids: Sequence[Any], id_type: pa.DataType,
                  columns: tuple[str, ...]) -> pa.Table:
    """One row per output: ``ids[output.id]`` (outputs carry prompt positions as ids), the
    generated columns, and the logprob columns."""
    schema = rollout_schema(id_type, columns)
    data = {"id": pa.array([ids[o.id] for o in outputs], type=id_type),
            **generated_columns(outputs)}
    for name in columns:
        attr = "logprobs" if name == "processed_logprobs" else name
        data[name] = pa.array([getattr(o, attr) for o in outputs], pa.list_(pa.float32()))
    return pa.Table.from_arrays([data[f.name] for f in schema], schema=schema)
