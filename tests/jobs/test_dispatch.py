"""The driver on a local Ray with fake actors: pulling, commits, retries, failures, resume."""

from __future__ import annotations

import json

import pytest

from jobs.manifest import MANIFEST, SUCCESS
from sampler import derive_seed
from jobs.runner import run_job
from tests.jobs.fakes import FakeActor
from tests.jobs.helpers import part_stats, read_output, write_jsonl, write_parquet

pytestmark = pytest.mark.ray


def _params(i: int) -> str:
    params = {"max_tokens": 1 + i % 4, "n": 1 + i % 2}
    if i % 3 == 0:
        params["seed"] = 1000 + i
    return json.dumps(params)


def _rows(n: int, start: int = 0, special: dict[int, str] | None = None) -> list[dict]:
    special = special or {}
    return [{"id": i, "prompt": special.get(i, f"prompt number {i}"),
             "sampling_params": _params(i), "tag": f"t{i}"} for i in range(start, start + n)]


def _config(tmp_path, model, name="out", **kw):
    return {"model": model, "input": str(tmp_path / "in"), "output": str(tmp_path / name),
            "num_actors": 2, "num_gpus_per_actor": 0, "rows_per_shard": 7,
            "sampling_params": {"logprobs": 1}, **kw}


def test_job_commits_every_shard_once(ray_local, tmp_path, tiny_llama):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(40), row_group_size=9)
    write_jsonl(tmp_path / "in" / "b.jsonl", _rows(23, start=40))
    res = run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    out = read_output(tmp_path / "out")
    n = [1 + i % 2 for i in range(63)]
    assert out.num_rows == sum(n) == res.rows
    assert res.input_rows == 63 and res.errors == 0 and res.shards == 6 + 4
    assert sorted(set(out.column("id").to_pylist())) == list(range(63))
    assert out.column("tag").to_pylist() == [f"t{i}" for i in range(63) for _ in range(n[i])]
    seeds = dict(zip(out.column("id").to_pylist(), out.column("seed").to_pylist()))
    assert seeds == {i: 1000 + i if i % 3 == 0 else derive_seed(0, i) for i in range(63)}
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert sorted(map(int, manifest["committed"])) == list(range(10))
    assert (tmp_path / "out" / SUCCESS).exists()
    assert set(res.actor_share) <= {"actor-0", "actor-1"}
    assert sum(res.actor_share.values()) == pytest.approx(1.0)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_actor_death_is_retried_and_output_matches_clean_run(ray_local, tmp_path, tiny_llama):
    marker = tmp_path / "died-once"
    write_parquet(tmp_path / "in" / "a.parquet", _rows(30, special={11: f"DIE-ONCE:{marker}"}))
    res = run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    assert marker.exists()
    assert res.shards_retried >= 1 and res.shards_failed == 0 and res.errors == 0
    marker2 = tmp_path / "already-died"
    marker2.touch()  # the clean run: the same prompt no longer kills
    (tmp_path / "in" / "a.parquet").unlink()
    write_parquet(tmp_path / "in" / "a.parquet", _rows(30, special={11: f"DIE-ONCE:{marker2}"}))
    clean = run_job(_config(tmp_path, tiny_llama, name="clean"), actor_cls=FakeActor,
                    progress=False)
    assert clean.shards_retried == 0
    assert read_output(tmp_path / "out").equals(read_output(tmp_path / "clean"))


def test_poison_shard_becomes_error_rows_after_max_attempts(ray_local, tmp_path, tiny_llama):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(21, special={9: "DIE-ALWAYS"}))
    res = run_job(_config(tmp_path, tiny_llama, max_shard_attempts=2), actor_cls=FakeActor,
                  progress=False)
    out = read_output(tmp_path / "out")
    assert res.shards_failed == 1
    errors = out.filter(out.column("finish_reason").to_numpy(zero_copy_only=False) == "error")
    assert sorted(errors.column("id").to_pylist()) == list(range(7, 14))  # shard 1, all rows
    for message in errors.column("error").to_pylist():
        assert "(shard 1)" in message and "failed after 2 attempts" in message
    good = out.filter(out.column("finish_reason").to_numpy(zero_copy_only=False) != "error")
    assert sorted(set(good.column("id").to_pylist())) == [*range(7), *range(14, 21)]


def test_broken_engine_replaces_actor_and_isolates_the_shard(ray_local, tmp_path, tiny_llama):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(28, special={20: "RAISE"}))
    res = run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    out = read_output(tmp_path / "out")
    errors = set(out.filter(out.column("finish_reason").to_numpy(zero_copy_only=False)
                            == "error").column("id").to_pylist())
    assert errors == set(range(14, 21))  # only the poison shard, not its batch-mates
    assert res.shards_failed == 1
    assert out.column("id").unique().to_pylist() == list(range(28))


def test_rerun_of_finished_job_recomputes_nothing(ray_local, tmp_path, tiny_llama):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(20))
    run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    before = part_stats(tmp_path / "out")
    res = run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    assert res.shards_skipped == res.shards == 3 and part_stats(tmp_path / "out") == before
    assert res.rows == sum(1 + i % 2 for i in range(20))


def test_resume_skips_committed_shards(ray_local, tmp_path, tiny_llama):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(35))
    run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    out = tmp_path / "out"
    manifest = json.loads((out / MANIFEST).read_text())
    for shard in ("1", "3"):  # as if the driver died before these commits
        del manifest["committed"][shard]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / SUCCESS).unlink()
    (out / "part-00003.parquet").unlink()
    (out / ".part-00001-1.parquet.tmp").write_bytes(b"half a file")
    before = part_stats(out)
    res = run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    after = part_stats(out)
    assert res.shards_skipped == 3
    for name in ("part-00000.parquet", "part-00002.parquet", "part-00004.parquet"):
        assert after[name] == before[name]
    assert after["part-00001.parquet"] != before["part-00001.parquet"]
    assert not (out / ".part-00001-1.parquet.tmp").exists()
    assert read_output(out).num_rows == res.rows == sum(1 + i % 2 for i in range(35))


def test_unwritable_part_fails_the_job_clearly_and_resumes(ray_local, tmp_path, tiny_llama):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(14))
    out = tmp_path / "out"
    run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["committed"]["1"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / SUCCESS).unlink()
    (out / "part-00001.parquet").unlink()
    (out / "part-00001.parquet" / "blocker").mkdir(parents=True)  # the rename cannot land
    with pytest.raises(OSError, match="output: shard 1: cannot write"):
        run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    assert "1" not in json.loads((out / MANIFEST).read_text())["committed"]
    (out / "part-00001.parquet" / "blocker").rmdir()
    (out / "part-00001.parquet").rmdir()
    res = run_job(_config(tmp_path, tiny_llama), actor_cls=FakeActor, progress=False)
    assert res.shards_skipped == 1 and read_output(out).num_rows == res.rows
