"""The rows of a benchmark job: the per-row sampling params it cycles, its Parquet input,
and the checks of its output (docs/design.md's schema, ids one-to-one, every token, logprobs
exactly where asked; the share of rows equal to the bare engine's)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

# per-row params, cycled over the rows (max_tokens / ignore_eos / detokenize are job defaults)
ROW_PARAMS: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.95},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 0.7, "top_p": 0.9, "logprobs": 5},
    {"temperature": 0.8, "top_p": 0.95, "seed": None},  # seed filled in per row
    {"temperature": 1.0, "logprobs": 20},
    {"temperature": 0.0, "logprobs": 0},
    {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": None},
)


def row_params(i: int) -> dict[str, Any]:
    p = dict(ROW_PARAMS[i % len(ROW_PARAMS)])
    if "seed" in p:
        p["seed"] = 1_000_003 * i + 7
    return p


def write_input(path: Path, rows: int, prompt_len: int, vocab: int) -> None:
    """``rows`` rows: id, prompt_token_ids (int32, fixed length), sampling_params (struct),
    group (passthrough)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    ids = rng.integers(100, vocab - 1, size=(rows, prompt_len), dtype=np.int32)
    fields = [("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int64()),
              ("min_p", pa.float64()), ("seed", pa.int64()), ("logprobs", pa.int64())]
    table = pa.table({
        "id": pa.array([f"row-{i:05d}" for i in range(rows)], pa.string()),
        "prompt_token_ids": pa.FixedSizeListArray.from_arrays(ids.reshape(-1), prompt_len)
        .cast(pa.list_(pa.int32())),
        "sampling_params": pa.array([row_params(i) for i in range(rows)], pa.struct(fields)),
        "group": pa.array([i % len(ROW_PARAMS) for i in range(rows)], pa.int64()),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=256)


def expected_schema():
    """docs/design.md's output table, with the ``group`` passthrough column."""
    import pyarrow as pa

    top = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
    return pa.schema([
        ("id", pa.string()), ("sample_index", pa.int32()), ("output_text", pa.string()),
        ("output_token_ids", pa.list_(pa.int32())), ("finish_reason", pa.string()),
        ("stop_reason", pa.string()), ("stop_token_id", pa.int32()),
        ("logprobs", pa.list_(pa.float32())),
        ("top_logprobs", pa.list_(pa.list_(top))), ("sampled_ranks", pa.list_(pa.int32())),
        ("prompt_logprobs", pa.list_(pa.float32())), ("prompt_token_ids", pa.list_(pa.int32())),
        ("prompt_top_logprobs", pa.list_(pa.list_(top))), ("num_prompt_tokens", pa.int32()),
        ("num_output_tokens", pa.int32()), ("seed", pa.int64()), ("error", pa.string()),
        ("group", pa.int64()),
    ])


def check_output(output: Path, rows: int, output_len: int,
                 text: bool = False) -> tuple[dict, Any]:
    """Checks a finished job's output (``text``: every row has its text, else none has);
    returns (checks, table sorted by id)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from jobs.manifest import SUCCESS

    checks: dict[str, bool] = {"success_marker": (output / SUCCESS).exists()}
    if not checks["success_marker"]:
        return checks, None
    table = pq.read_table(str(output)).sort_by([("id", "ascending"),
                                                ("sample_index", "ascending")])
    checks["schema"] = table.schema.equals(expected_schema())
    ids = Counter(table.column("id").to_pylist())
    checks["ids_one_to_one"] = ids == Counter(f"row-{i:05d}" for i in range(rows))
    checks["row_count"] = table.num_rows == rows
    checks["no_errors"] = table.column("error").null_count == table.num_rows
    texts = table.column("output_text")
    checks["text_where_asked"] = texts.null_count == (0 if text else table.num_rows)
    checks["all_tokens"] = (pc.all(pc.equal(table.column("num_output_tokens"), output_len))
                            .as_py() and pc.all(pc.equal(pc.list_value_length(
                                table.column("output_token_ids")), output_len)).as_py())
    wanted = [row_params(int(i[4:])).get("logprobs") for i in table.column("id").to_pylist()]
    logprobs = table.column("logprobs").to_pylist()
    top = table.column("top_logprobs").to_pylist()
    checks["logprobs_where_asked"] = all(
        (lp is None) == (k is None) and (k is None or len(lp) == output_len)
        and (not k or (len(t) == output_len and all(len(s) == k for s in t)))
        for k, lp, t in zip(wanted, logprobs, top))
    return checks, table


def token_match(table, bare_tokens: str) -> float:
    """Share of rows whose output token ids equal the bare engine's."""
    import pyarrow.parquet as pq

    bare = pq.read_table(bare_tokens).sort_by("id")
    same = sum(a == b for a, b in zip(table.column("output_token_ids").to_pylist(),
                                      bare.column("output_token_ids").to_pylist()))
    return same / max(table.num_rows, 1)
