"""A Parquet job whose rows carry their own structured-output constraints (a struct column,
``json`` as JSON text), with job defaults constraining the rows that set none; a bad
constraint is that row's error; a second run gives the same rows."""

from __future__ import annotations

import json

import pytest

from jobs.runner import run_job
from tests.actors.engine.structured_checks import (ARITHMETIC_LARK, DATE_REGEX, PERSON_SCHEMA,
                                            check_output)
from tests.jobs.helpers import assert_same_rows, read_output, write_parquet

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CONSTRAINTS = [
    {"json": json.dumps(PERSON_SCHEMA), "disable_any_whitespace": True},
    {"regex": DATE_REGEX},
    {"choice": ["red", "green", "blue"]},
    {"grammar": ARITHMETIC_LARK},
    {"json_object": True, "disable_any_whitespace": True},
    None,  # the job default: a choice
]
DEFAULT = {"choice": ["yes", "no"]}


def _rows() -> list[dict]:
    rows = []
    for i in range(24):
        so = CONSTRAINTS[i % len(CONSTRAINTS)]
        params = {"max_tokens": 120, "temperature": 1.0}
        if so is not None:
            params["structured_outputs"] = so
        rows.append({"id": f"r{i:02d}", "prompt": f"Row {i}: answer", "sampling_params": params})
    rows.append({"id": "bad", "prompt": "x", "sampling_params": {
        "max_tokens": 8, "structured_outputs": {"json": json.dumps({"type": "objectx"})}}})
    return rows


def test_parquet_job_with_per_row_constraints(ray_local, tiny_llama, tmp_path):
    rows = _rows()
    write_parquet(tmp_path / "in" / "a.parquet", rows)

    def config(out):
        return {"model": tiny_llama, "input": str(tmp_path / "in"), "output": str(out),
                "num_actors": 1, "num_gpus_per_actor": 0, "rows_per_shard": 10, "seed": 5,
                "sampling_params": {"max_tokens": 16, "structured_outputs": DEFAULT},
                "engine": {"max_num_seqs": 16, "max_model_len": 192, "num_kv_blocks": 256}}

    result = run_job(config(tmp_path / "out"), progress=False)
    assert result.errors == 1
    table = read_output(tmp_path / "out").to_pylist()
    by_id = {r["id"]: r for r in table}
    bad = by_id.pop("bad")
    assert bad["finish_reason"] == "error"
    assert "sampling_params.structured_outputs.json" in bad["error"]
    stopped = 0
    for i, row in enumerate(rows[:-1]):
        out = by_id[row["id"]]
        so = CONSTRAINTS[i % len(CONSTRAINTS)]
        so = dict(so, json=json.loads(so["json"])) if so and "json" in so else (so or DEFAULT)
        assert out["error"] is None and out["finish_reason"] in ("stop", "length")
        if out["finish_reason"] == "stop":
            stopped += 1
            check_output(_Out(out["output_text"]), so)
    assert stopped >= 18
    # the same job again (a retried shard reads the same rows): the same outputs
    run_job(config(tmp_path / "again"), progress=False)
    assert_same_rows(read_output(tmp_path / "out"), read_output(tmp_path / "again"))


class _Out:
    def __init__(self, text: str) -> None:
        self.output_text = text
