"""Shared test helpers: one local Ray per session, input files, reading the output back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_STARTED: list[bool] = []


def local_ray_session():
    """Starts (once) a local Ray on 127.0.0.1 with 2 CPUs; shuts it down at session end."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        _STARTED.append(True)
    yield ray
    if _STARTED:
        _STARTED.clear()
        ray.shutdown()


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def read_output(path: str | os.PathLike) -> pa.Table:
    """Every part file of an output directory, sorted by (id, sample_index)."""
    table = pq.read_table(str(path))
    return table.sort_by([("id", "ascending"), ("sample_index", "ascending")])


def part_stats(path: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """part file name -> (inode, mtime_ns), to prove files were not rewritten."""
    out = {}
    for p in sorted(Path(path).glob("part-*.parquet")):
        st = p.stat()
        out[p.name] = (st.st_ino, st.st_mtime_ns)
    return out


def _same(x: Any, y: Any, atol: float) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= atol
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b, atol) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k], atol) for k in x)
    return x == y


def assert_same_rows(a: pa.Table, b: pa.Table, atol: float = 1e-4) -> None:
    """Equal schemas and rows; every non-float value identical, float values (logprobs)
    within ``atol``: what stays fixed when batch composition changes between runs."""
    assert a.schema.equals(b.schema), (a.schema, b.schema)
    assert a.num_rows == b.num_rows
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        bad = [i for i in range(len(x)) if not _same(x[i], y[i], atol)]
        assert not bad, f"column {name!r} differs in {len(bad)} rows, e.g. {x[bad[0]]!r} vs " \
                        f"{y[bad[0]]!r}"
