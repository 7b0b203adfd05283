"""The manifest: created at start, refused for another job, atomic records, temp cleanup,
kept in ``.raygen/`` (older outputs' root markers moved there)."""

from __future__ import annotations

import json

import pytest

from jobs.manifest import (LEGACY_MANIFEST, LEGACY_SUCCESS, MANIFEST, STATE_DIR, Manifest,
                           decode_schema, encode_schema, read_manifest)
from jobs.storage import resolve

IDENTITY = {"model": "m", "seed": 0}
PLAN = {"files": [{"path": "/x.parquet", "format": "parquet", "rows": 10, "size": 99}],
        "rows_per_shard": 5, "shards": [[0, 0, 5], [0, 5, 10]]}


def test_created_then_reopened_with_commits(tmp_path):
    out = resolve(str(tmp_path / "out"))
    m = Manifest.open(out, IDENTITY, PLAN)
    assert read_manifest(tmp_path / "out")["committed"] == {}
    m.record(1, {"rows": 5})
    again = Manifest.open(out, IDENTITY, PLAN)
    assert again.is_committed(1) and not again.is_committed(0) and not again.finished
    again.finish()
    assert (tmp_path / "out" / STATE_DIR / "SUCCESS").exists()
    assert Manifest.open(out, IDENTITY, PLAN).finished
    assert [p.name for p in (tmp_path / "out").iterdir()] == [STATE_DIR]
    assert sorted(p.name for p in (tmp_path / "out" / STATE_DIR).iterdir()) == [
        "SUCCESS", "manifest.parquet"]


def test_other_config_or_input_is_refused(tmp_path):
    out = resolve(str(tmp_path / "out"))
    Manifest.open(out, IDENTITY, PLAN)
    with pytest.raises(ValueError, match=r"different configuration \(differs in: seed\)"):
        Manifest.open(out, {**IDENTITY, "seed": 1}, PLAN)
    other_rows = {**PLAN, "files": [{**PLAN["files"][0], "rows": 11}]}
    with pytest.raises(ValueError, match="different input files or rows"):
        Manifest.open(out, IDENTITY, other_rows)
    with pytest.raises(ValueError, match="different shard plan"):
        Manifest.open(out, IDENTITY, {**PLAN, "rows_per_shard": 2})


def test_foreign_directory_and_corrupt_manifest_are_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "results.csv").write_text("x")
    with pytest.raises(ValueError, match=r"not empty and holds no raygen manifest \(found "
                                         r"results.csv\)"):
        Manifest.open(resolve(str(tmp_path / "data")), IDENTITY, PLAN)
    (tmp_path / "bad" / STATE_DIR).mkdir(parents=True)
    (tmp_path / "bad" / MANIFEST).write_text("{half")
    with pytest.raises(ValueError, match="is not a raygen manifest"):
        Manifest.open(resolve(str(tmp_path / "bad")), IDENTITY, PLAN)


def test_unwritable_output_is_a_job_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="output: cannot use"):
        Manifest.open(resolve(str(tmp_path / "file" / "out")), IDENTITY, PLAN)


def test_temporaries_are_cleaned(tmp_path):
    out = resolve(str(tmp_path / "out"))
    m = Manifest.open(out, IDENTITY, PLAN)
    for name in (".part-00000-1.parquet.tmp", f"{STATE_DIR}/.manifest.parquet.tmp"):
        (tmp_path / "out" / name).write_bytes(b"partial")
    assert sorted(m.clean_temporaries()) == [".manifest.parquet.tmp",
                                             ".part-00000-1.parquet.tmp"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == [STATE_DIR]
    assert [p.name for p in (tmp_path / "out" / STATE_DIR).iterdir()] == ["manifest.parquet"]


def test_an_older_outputs_root_markers_move_into_the_state_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    old = {"version": 1, "config": IDENTITY, "plan": PLAN, "committed": {"0": {"rows": 5}}}
    (out / LEGACY_MANIFEST).write_text(json.dumps(old))
    (out / LEGACY_SUCCESS).write_bytes(b"")
    m = Manifest.open(resolve(str(out)), IDENTITY, PLAN)
    assert m.is_committed(0) and m.finished
    assert read_manifest(out)["committed"] == {"0": {"rows": 5}}
    assert [p.name for p in out.iterdir()] == [STATE_DIR]


def test_schema_round_trip():
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("x", pa.list_(pa.struct([("a", pa.int32())])))])
    assert decode_schema(encode_schema(schema)).equals(schema)
