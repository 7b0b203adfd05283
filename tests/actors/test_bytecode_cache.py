"""Actor processes cache compiled bytecode when the environment forbids writing it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from actors.actor import cache_bytecode


@pytest.fixture
def no_bytecode(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)


def test_a_process_that_may_not_write_bytecode_caches_it_under_the_prefix(no_bytecode, tmp_path,
                                                                         monkeypatch):
    target = tmp_path / "cache"
    monkeypatch.setenv("RAYGEN_PYCACHE", str(target))
    assert cache_bytecode() == str(target)
    assert sys.pycache_prefix == str(target) and not sys.dont_write_bytecode
    assert target.is_dir() and target.stat().st_mode & 0o777 == 0o700


def test_a_directory_others_may_write_is_refused(no_bytecode, tmp_path, monkeypatch):
    """Bytecode found in the cache is executed: a directory another user can write into (a
    shared /tmp planted in advance, say) is not used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("RAYGEN_PYCACHE", str(shared))
    assert cache_bytecode() is None
    assert sys.dont_write_bytecode and sys.pycache_prefix is None


def test_off_or_an_existing_choice_leaves_the_process_alone(no_bytecode, monkeypatch, tmp_path):
    monkeypatch.setenv("RAYGEN_PYCACHE", "off")
    assert cache_bytecode() is None
    assert sys.dont_write_bytecode and sys.pycache_prefix is None
    monkeypatch.setenv("RAYGEN_PYCACHE", str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # bytecode is written already
    assert cache_bytecode() is None and sys.pycache_prefix is None
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", "/elsewhere")  # the user chose a prefix
    assert cache_bytecode() is None and sys.pycache_prefix == "/elsewhere"


def test_later_imports_are_compiled_into_the_cache_and_read_from_it(tmp_path):
    """In a fresh interpreter started with PYTHONDONTWRITEBYTECODE=1: a module imported after
    the call leaves its .pyc under the prefix, and the next process imports it from there."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "cached_mod.py").write_text("VALUE = 41 + 1\n")
    cache = tmp_path / "cache"
    code = ("import sys; from actors.actor import cache_bytecode; "
            f"sys.path.insert(0, {str(src)!r}); print(cache_bytecode()); "
            "import cached_mod; print(cached_mod.VALUE, cached_mod.__cached__)")
    env = {"PYTHONDONTWRITEBYTECODE": "1", "RAYGEN_PYCACHE": str(cache),
           "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2]),
           "PATH": "/usr/bin:/bin"}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert first[0] == str(cache) and first[1] == "42"
    pyc = list(cache.rglob("cached_mod*.pyc"))
    assert len(pyc) == 1 and first[2] == str(pyc[0])
    assert not (src / "__pycache__").exists()
    stamp = pyc[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True).stdout.split()
    assert second[1] == "42" and pyc[0].stat().st_mtime_ns == stamp  # read, not rewritten


def test_an_actors_constructor_arguments_unpickle_without_the_engine_modules(tmp_path):
    """Ray unpickles an actor's arguments (its first ``ShardTask``) before the constructor
    enables the bytecode cache: unpickling them, and importing the actor's module, must not
    import torch, transformers or the engine, which would then be compiled from source."""
    import pickle

    import pyarrow as pa
    import pyarrow.fs as pafs

    from actors.engine.engine_config import EngineConfig
    from actors.shard import ShardTask

    fs = pafs.LocalFileSystem()
    task = ShardTask(3, 1, fs, str(tmp_path / "in.parquet"), "parquet", 0, 8,
                     {"id": "id", "token_ids": "prompt_token_ids"}, {"max_tokens": 4}, 7, fs,
                     str(tmp_path / "out"), pa.schema([("id", pa.string())]))
    args = pickle.dumps(("/models/m", EngineConfig(max_num_seqs=8), task))
    code = ("import pickle, sys; import actors.actor; "
            f"model, config, task = pickle.loads(bytes.fromhex({args.hex()!r})); "
            "print(type(task).__module__, task.part_name, task.schema.names, "
            "[m for m in ('torch', 'transformers', 'sampler', 'actors.engine.llm_engine', 'actors.shard') "
            "if m in sys.modules])")
    env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2]),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip().split(maxsplit=2)
    assert out == ["actors.contract.task", "part-00003.parquet", "['id'] []"]
