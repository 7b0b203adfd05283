"""Input discovery: formats, row counts, column checks, the unified output schema, the plan."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.feather as feather
import pytest

from actors.contract.schema import GENERATED_FIELDS
from jobs.config import JobConfig
from jobs.sources import discover, file_format
from jobs.plan import plan_shards
from tests.jobs.helpers import write_jsonl, write_parquet


def _cfg(path, **kw) -> JobConfig:
    return JobConfig.from_dict({"model": "m", "input": str(path), "output": "o", **kw})


def test_three_formats_one_schema(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"id": i, "prompt": "p", "lang": "en"}
                                           for i in range(5)])
    write_jsonl(tmp_path / "b.jsonl", [{"id": 5 + i, "messages": [{"role": "user",
                                                                   "content": "c"}],
                                        "score": 0.5} for i in range(3)])
    feather.write_feather(pa.table({"id": [8, 9], "prompt_token_ids": [[1, 2], [3]]}),
                          tmp_path / "c.feather")
    spec = discover(_cfg(tmp_path))
    assert [(f.format, f.rows, f.row_offset) for f in spec.files] == [
        ("parquet", 5, 0), ("json", 3, 5), ("ipc", 2, 8)]
    assert spec.total_rows == 10 and not spec.generated_ids
    assert spec.columns == {"id": "id", "prompt": "prompt", "messages": "messages",
                            "token_ids": "prompt_token_ids"}
    schema = spec.schema
    # the prompt text and messages pass through; token ids are the generated column's
    assert schema.names == ["id", *[f.name for f in GENERATED_FIELDS], "prompt", "lang",
                            "messages", "score"]
    assert schema.field("id").type == pa.int64()
    assert schema.field("lang").type == pa.string() and schema.field("score").type == pa.float64()


def test_uri_and_glob_inputs(tmp_path):
    write_parquet(tmp_path / "d" / "a.parquet", [{"prompt": "x"}] * 2)
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"prompt": "y"}] * 3)
    write_parquet(tmp_path / "d" / "skip.parquet.bak", [{"prompt": "z"}])
    spec = discover(_cfg(tmp_path, input=[f"file://{tmp_path}/d/*.parquet",
                                          str(tmp_path / "d" / "b.jsonl")]))
    assert [(f.path.rsplit("/", 1)[1], f.rows) for f in spec.files] == [("a.parquet", 2),
                                                                         ("b.jsonl", 3)]


def test_generated_ids_are_strings(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}] * 3)
    spec = discover(_cfg(tmp_path / "a.jsonl"))
    assert spec.generated_ids and spec.schema.field("id").type == pa.string()


def test_plan_cuts_files_into_ranges(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"prompt": "x"}] * 10)
    write_parquet(tmp_path / "b.parquet", [{"prompt": "y"}] * 3)
    shards = plan_shards(discover(_cfg(tmp_path)), 4)
    assert [(s.file_index, s.row_start, s.row_stop) for s in shards] == [
        (0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 0, 3)]
    assert [s.shard_id for s in shards] == [0, 1, 2, 3]


@pytest.mark.parametrize("rows,match", [
    ([{"text": "x"}], r"has none of the prompt columns 'prompt', 'messages', 'prompt_token_ids'"),
    ([{"prompt": 3}], r"column 'prompt' of .*a.parquet must be string, got int64"),
    ([{"prompt": "x", "sampling_params": 3}], r"'sampling_params' .* must be struct or JSON"),
    ([{"prompt_token_ids": ["a"]}], r"'prompt_token_ids' .* must be list<int>"),
    ([{"prompt": "x", "seed": 1}], r"column 'seed' collides with the output column"),
    ([{"prompt": "x", "id": [1]}], r"column 'id' .* must be integer or string"),
])
def test_bad_columns_fail_with_one_clear_message(tmp_path, rows, match):
    write_parquet(tmp_path / "a.parquet", rows)
    with pytest.raises(ValueError, match=match):
        discover(_cfg(tmp_path))


def test_id_column_missing_in_one_file(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"id": 1, "prompt": "x"}])
    write_parquet(tmp_path / "b.parquet", [{"prompt": "x"}])
    with pytest.raises(ValueError, match=r"id column 'id' is missing from .*b.parquet"):
        discover(_cfg(tmp_path))


def test_disagreeing_types_across_files(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"prompt": "x", "k": 1}])
    write_parquet(tmp_path / "b.parquet", [{"prompt": "x", "k": [1]}])
    with pytest.raises(ValueError, match="disagree on column types"):
        discover(_cfg(tmp_path))


def test_unreadable_empty_and_unknown_inputs(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"input: cannot read .*bad.parquet"):
        discover(_cfg(tmp_path / "bad.parquet"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="is not a known format"):
        discover(_cfg(tmp_path / "notes.txt"))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "readme.md").write_text("x")
    with pytest.raises(ValueError, match="matches no Parquet, Arrow or JSONL file"):
        discover(_cfg(tmp_path / "e"))
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="has no rows"):
        discover(_cfg(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match="does not exist"):
        discover(_cfg(tmp_path / "missing-dir"))


def test_custom_column_names(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"uid": "r1", "text": "hello", "params": {"n": 2}}])
    spec = discover(_cfg(tmp_path, id_column="uid", prompt_column="text",
                         params_column="params"))
    assert spec.columns == {"id": "uid", "prompt": "text", "params": "params"}
    assert spec.schema.field("id").type == pa.string() and "uid" not in spec.schema.names


@pytest.mark.parametrize("name,fmt", [("a.parquet", "parquet"), ("a.PQ", "parquet"),
                                      ("x.arrow", "ipc"), ("x.feather", "ipc"),
                                      ("x.jsonl", "json"), ("x.jsonl.gz", "json"),
                                      ("x.csv", None), ("x.gz", None)])
def test_file_format(name, fmt):
    assert file_format(name) == fmt


def test_jsonl_rows_of_mixed_types_name_the_column_and_the_line(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "messages": chat}, {"id": 2, "messages": chat},
                                       {"id": 3, "messages": "hi"}, {"id": 4, "messages": chat}])
    with pytest.raises(ValueError) as info:
        discover(_cfg(tmp_path / "a.jsonl"))
    assert str(info.value) == (
        f"input: {tmp_path / 'a.jsonl'} line 3: column 'messages' holds a string, but a list "
        "on line 1; every line must give a column the same type")
