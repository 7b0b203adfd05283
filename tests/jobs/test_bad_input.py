"""Bad input, property-based (issue 8): hypothesis draws shards of rows with random
sampling_params (wrong types, NaN, inf, negative, huge n, unknown fields, JSON garbage),
empty, very long, unicode and invalid UTF-8 prompts, invalid token ids, chat messages, null
ids, extra and missing columns. Each shard goes through the actor's code path (Parquet file ->
``process_shard`` -> ``EngineServer`` -> the real engine on a tiny model -> part file):

- nothing raises; every input row comes out (n rows if good, error rows if bad);
- every bad row's error starts with ``row id <id> (shard 0): `` (its position when the id
  is null) and names the field that is wrong;
- the good rows are bit-identical to a clean run of only the good rows;
- the same rows as JSONL, params as JSON objects (rows disagreeing on types), give the same
  rows as the Parquet file.
"""

from __future__ import annotations

import json
import re
import tempfile
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings

from actors.contract.schema import GENERATED_FIELDS
from actors.serving import EngineServer
from actors.shard import process_shard
from jobs.config import JobConfig
from jobs.sources import discover
from jobs.plan import make_task, plan_shards
from jobs.runner import engine_options
from jobs.storage import resolve
from tests.jobs.bad_input_data import MAX_MODEL_LEN, MAX_NUM_SEQS, Row, rows
from tests.jobs.helpers import assert_identical

pytestmark = pytest.mark.slow

ENGINE = {"max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64}
DEFAULTS = {"max_tokens": 2}


@pytest.fixture(scope="module")
def engine_server(tiny_llama):
    from actors.engine.llm_engine import Engine

    cfg = JobConfig.from_dict({"model": tiny_llama, "input": "x", "output": "o",
                               "num_gpus_per_actor": 0, "engine": ENGINE})
    engine = Engine(tiny_llama, engine_options(cfg))
    return engine, EngineServer(engine)


@pytest.fixture(scope="module")
def tokenizer(engine_server):
    return engine_server[0].tokenizer


def _table(drawn: list[Row]) -> pa.Table:
    prompts = pa.array([r.prompt.encode() if isinstance(r.prompt, str) else r.prompt
                        for r in drawn], pa.binary()).view(pa.string())  # keeps bad UTF-8
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    columns = {
        "id": pa.array([r.id for r in drawn], pa.string()),
        "prompt": prompts,
        "prompt_token_ids": pa.array([r.token_ids for r in drawn], pa.list_(pa.int64())),
        "messages": pa.array([r.messages for r in drawn], pa.list_(message)),
        "sampling_params": pa.array([r.params for r in drawn], pa.string()),
    }
    for name, typ in (("score", pa.float64()), ("note", pa.string())):
        if any(r.extra for r in drawn):  # extra columns, only in some shards
            columns[name] = pa.array([r.extra.get(name) for r in drawn], typ)
    for name in ("prompt_token_ids", "messages", "sampling_params"):  # missing columns
        if columns[name].null_count == len(drawn):
            del columns[name]
    return pa.table(columns)


def _jsonl(drawn: list[Row], path: Path) -> None:
    """The rows as JSONL: params as JSON objects where they are one (so rows disagree on
    types and the line reader of actors/contract/jsonl.py takes over), else as text."""
    with open(path, "w") as f:
        for r in drawn:
            params: object = r.params
            try:
                parsed = json.loads(r.params) if r.params is not None else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                params = parsed
            record = {"id": r.id, "prompt": r.prompt, "prompt_token_ids": r.token_ids,
                      "messages": r.messages, "sampling_params": params, **r.extra}
            f.write(json.dumps({k: v for k, v in record.items()
                                if v is not None or k in ("id", "prompt")}) + "\n")


def _run_shard(root: Path, model: str, table: pa.Table | list[Row],
               server: EngineServer) -> pa.Table:
    (root / "in").mkdir(parents=True)
    if isinstance(table, pa.Table):
        pq.write_table(table, root / "in" / "rows.parquet")
    else:
        _jsonl(table, root / "in" / "rows.jsonl")
    config = JobConfig.from_dict({"model": model, "input": str(root / "in"),
                                  "output": str(root / "out"), "rows_per_shard": 100,
                                  "seed": 5, "sampling_params": DEFAULTS, "engine": ENGINE})
    spec, output = discover(config), resolve(config.output)
    output.fs.create_dir(output.path)
    [shard] = plan_shards(spec, config.rows_per_shard)
    task = make_task(shard, 1, spec, config, output)
    process_shard(task, partial(server.run, exclusive=True))
    return pq.read_table(root / "out" / task.part_name)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=pytest.importorskip("hypothesis.strategies").data())
def test_bad_rows_become_error_rows_and_good_rows_equal_a_clean_run(data, engine_server,
                                                                    tokenizer, tiny_llama):
    drawn = data.draw(rows(tokenizer))
    table = _table(drawn)
    server = engine_server[1]
    with tempfile.TemporaryDirectory() as tmp:
        part = _run_shard(Path(tmp) / "mixed", tiny_llama, table, server)
        out = part.to_pylist()
        # every input row comes out, in input order, and nothing else does
        by_row: dict[int, list[dict]] = {}
        position = 0
        for i, row in enumerate(drawn):
            mine = []
            while position < len(out) and out[position]["id"] == row.id and (
                    len(mine) < row.n if not row.bad else row.id is not None
                    or out[position]["error"].startswith(f"row {i} of ")):
                mine.append(out[position])
                position += 1
            by_row[i] = mine
        assert position == len(out), f"extra output rows: {out[position:]}"
        for i, row in enumerate(drawn):
            mine = by_row[i]
            assert mine, f"row {i} ({row.id!r}) has no output row"
            if row.bad:
                prefix = (f"row id {row.id!r} (shard 0): " if row.id is not None
                          else f"row {i} of ")
                for o in mine:
                    error = o["error"]
                    assert o["finish_reason"] == "error" and error, (row, o)
                    assert error.startswith(prefix), (error, row)
                    assert any(all(w in error for w in words) for words in row.errors), \
                        (error, row.errors, row)
            else:
                assert [o["sample_index"] for o in mine] == list(range(row.n)), (row, mine)
                for o in mine:
                    assert o["error"] is None and o["finish_reason"] in ("stop", "length"), \
                        (row, o)
        good = [i for i, row in enumerate(drawn) if not row.bad]
        if good:
            clean = _run_shard(Path(tmp) / "clean", tiny_llama, table.take(good), server)
            mine = pa.Table.from_pylist([o for i in good for o in by_row[i]], schema=part.schema)
            assert_identical(mine, clean)
        if not any(isinstance(r.prompt, bytes) for r in drawn):  # JSONL holds valid UTF-8
            lines = _run_shard(Path(tmp) / "jsonl", tiny_llama, drawn, server)
            names = ["id", *(f.name for f in GENERATED_FIELDS)]
            assert_identical(_same_paths(lines.select(names)), _same_paths(part.select(names)))


def _same_paths(table: pa.Table) -> pa.Table:
    """The error column with the input file's path left out (rows without an id name it)."""
    errors = [None if e is None else re.sub(r" of \S+/rows\.(parquet|jsonl) ", " of FILE ", e)
              for e in table.column("error").to_pylist()]
    return table.set_column(table.schema.get_field_index("error"), "error",
                            pa.array(errors, pa.string()))


def test_a_jsonl_row_that_breaks_the_file_fails_the_job_before_any_work(tmp_path):
    """A line pyarrow cannot parse (here a lone surrogate escape) makes the whole file
    unreadable: the job stops before Ray or a model starts, naming the file."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(
        json.dumps({"id": "a", "prompt": "fine"}) + "\n" + '{"id": "b", "prompt": "\\ud800"}\n')
    config = JobConfig.from_dict({"model": "m", "input": str(tmp_path / "in"),
                                  "output": str(tmp_path / "out")})
    with pytest.raises(ValueError, match=r"input: cannot read .*a\.jsonl: .*surrogate"):
        discover(config)
