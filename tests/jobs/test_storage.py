"""Filesystem resolution, listing and globbing; atomic writes."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from jobs.storage import list_files, read_bytes, resolve, write_atomic


def _touch(root, *names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")


def test_local_path_file_uri_and_directory(tmp_path):
    _touch(tmp_path, "d/a.parquet", "d/sub/b.jsonl", "d/_hidden.parquet", "d/.tmp.parquet",
           "d/_meta/c.parquet")
    loc = resolve(str(tmp_path / "d"))
    assert isinstance(loc.fs, pafs.LocalFileSystem)
    assert list_files(loc) == [str(tmp_path / "d/a.parquet"), str(tmp_path / "d/sub/b.jsonl")]
    uri = resolve(f"file://{tmp_path}/d/a.parquet")
    assert list_files(uri) == [str(tmp_path / "d/a.parquet")]


@pytest.mark.parametrize("pattern,expected", [
    ("d/*.parquet", ["d/a.parquet", "d/z.parquet"]),
    ("d/**/*.parquet", ["d/a.parquet", "d/sub/deeper/c.parquet", "d/sub/y.parquet",
                        "d/z.parquet"]),
    ("d/?.parquet", ["d/a.parquet", "d/z.parquet"]),
    ("d/[a-m].*", ["d/a.parquet", "d/b.jsonl"]),
    ("d/sub/*", ["d/sub/y.parquet"]),
])
def test_globs_stay_within_components(tmp_path, pattern, expected):
    _touch(tmp_path, "d/a.parquet", "d/b.jsonl", "d/z.parquet", "d/sub/y.parquet",
           "d/sub/deeper/c.parquet")
    got = list_files(resolve(str(tmp_path / pattern)))
    assert got == [str(tmp_path / e) for e in expected]
    assert list_files(resolve(f"file://{tmp_path}/{pattern}")) == got


def test_fsspec_uri(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/raygen-test/x/a.jsonl", b'{"prompt": "hi"}\n')
    fs.pipe("/raygen-test/x/b.jsonl", b'{"prompt": "ho"}\n')
    loc = resolve("memory://raygen-test/x/*.jsonl")
    assert [p.rsplit("/", 1)[1] for p in list_files(loc)] == ["a.jsonl", "b.jsonl"]


def test_missing_and_unknown(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list_files(resolve(str(tmp_path / "nope.parquet")))
    with pytest.raises(ValueError, match="unknown URI scheme 'nosuchproto'"):
        resolve("nosuchproto://bucket/x.parquet")


def test_write_atomic_replaces_whole_file(tmp_path):
    fs = pafs.LocalFileSystem()
    target = str(tmp_path / "m.json")
    write_atomic(fs, target, b"one")
    write_atomic(fs, target, b"two")
    assert read_bytes(fs, target) == b"two"
    assert read_bytes(fs, str(tmp_path / "none")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
