"""The driver on a local Ray with fake actors: pulling, commits, retries, failures, resume."""

from __future__ import annotations

import json

import pytest

from jobs.manifest import MANIFEST, SUCCESS, manifest_bytes, read_manifest
from jobs.runner import run_job
from sampler import derive_seed
from tests.jobs.fakes import BrokenActor, FakeActor, dies_while_starting
from tests.jobs.helpers import part_stats, read_output, temporaries, write_jsonl, write_parquet

pytestmark = pytest.mark.ray


def _params(i: int) -> str:
    params = {"max_tokens": 1 + i % 4, "n": 1 + i % 2}
    if i % 3 == 0:
        params["seed"] = 1000 + i
    return json.dumps(params)


def _rows(n: int, start: int = 0, special: dict[int, str] | None = None) -> list[dict]:
    """Rows whose prompts all have three words (a fault prompt keeps that count)."""
    special = special or {}
    return [{"id": i, "prompt": f"{special.get(i, 'prompt')} number {i}",
             "sampling_params": _params(i), "tag": f"t{i}"} for i in range(start, start + n)]


def _write_input(root, special=None):
    write_parquet(root / "a.parquet", _rows(40, special=special), row_group_size=9)
    write_jsonl(root / "b.jsonl", _rows(23, start=40, special=special))


def _config(model, input_dir, output, **kw):
    return {"model": model, "input": str(input_dir), "output": str(output), "num_actors": 2,
            "num_gpus_per_actor": 0, "rows_per_shard": 7, "sampling_params": {"logprobs": 1},
            **kw}


def _n(i: int) -> int:
    return 1 + i % 2


@pytest.fixture(scope="module")
def clean_run(ray_local, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("dispatch")
    _write_input(root / "in")
    result = run_job(_config(tiny_llama, root / "in", root / "out"), actor_cls=FakeActor,
                     progress=False)
    return root, result, read_output(root / "out")


def test_job_commits_every_shard_once(clean_run):
    root, res, out = clean_run
    assert out.num_rows == sum(_n(i) for i in range(63)) == res.rows
    assert res.input_rows == 63 and res.errors == 0 and res.shards == 6 + 4
    assert res.shards_retried == 0 and res.shards_skipped == 0
    assert sorted(set(out.column("id").to_pylist())) == list(range(63))
    assert out.column("tag").to_pylist() == [f"t{i}" for i in range(63) for _ in range(_n(i))]
    seeds = dict(zip(out.column("id").to_pylist(), out.column("seed").to_pylist()))
    assert seeds == {i: 1000 + i if i % 3 == 0 else derive_seed(0, i) for i in range(63)}
    manifest = read_manifest(root / "out")
    assert sorted(map(int, manifest["committed"])) == list(range(10))
    assert (root / "out" / SUCCESS).exists()
    assert set(res.actor_share) <= {"actor-0", "actor-1"}
    assert sum(res.actor_share.values()) == pytest.approx(1.0)
    assert not temporaries(root / "out")


def test_each_first_actor_reads_its_first_shard_while_it_starts(ray_local, tiny_llama,
                                                               tmp_path, caplog):
    """The first pool's actors get their first shard with the constructor: those two shards
    (0 and 1, one per actor) report a prefetch phase, every later shard reads its own rows."""
    import logging
    import re

    write_parquet(tmp_path / "in" / "a.parquet", _rows(35), row_group_size=9)
    caplog.set_level(logging.INFO, logger="jobs.runner")
    res = run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out"), actor_cls=FakeActor,
                  progress=False)
    assert res.shards == 5 and res.errors == 0
    lines = {int(m.group(1)): m.group(3) for r in caplog.records
             if (m := re.match(r"shard (\d+) by (actor-\d): (.*)", r.getMessage()))}
    assert sorted(lines) == [0, 1, 2, 3, 4]
    assert [s for s, text in sorted(lines.items()) if text.startswith("prefetch ")] == [0, 1]
    assert all(text.startswith("prepare ") for s, text in lines.items() if s >= 2)


def _but_prompt(table):
    return table.drop_columns(["prompt"])


def test_actor_death_is_retried_and_output_matches_clean_run(clean_run, tiny_llama, tmp_path):
    marker = tmp_path / "died-once"
    _write_input(tmp_path / "in", special={11: f"DIE-ONCE:{marker}", 45: f"DIE-ONCE:{marker}"})
    res = run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out"), actor_cls=FakeActor,
                  progress=False)
    assert marker.exists()
    assert res.shards_retried >= 1 and res.shards_failed == 0 and res.errors == 0
    # the same rows as the clean run; only the carried prompt text differs (the dying rows')
    assert _but_prompt(read_output(tmp_path / "out")).equals(_but_prompt(clean_run[2]))


def test_actor_death_with_many_shared_shards_on_it_loses_and_duplicates_nothing(
        clean_run, tiny_llama, tmp_path):
    """Shards that share the engine (deterministic: false) of 28 sequences: up to 4 of the
    7-row shards at once on the one actor. Its death (once a second shard runs beside the
    dying one) takes every shard it holds; all of them run again as retries."""
    marker = tmp_path / "died-once"
    _write_input(tmp_path / "in",
                 special={11: f"DIE-SHARED:{marker}", 45: f"DIE-SHARED:{marker}"})
    res = run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out", deterministic=False,
                          num_actors=1, engine={"max_num_seqs": 28}),
                  actor_cls=FakeActor, progress=False)
    assert marker.exists()
    assert res.shards_retried >= 2
    assert res.shards_failed == 0 and res.errors == 0
    # the same rows as the clean run; only the carried prompt text differs (the dying rows')
    assert _but_prompt(read_output(tmp_path / "out")).equals(_but_prompt(clean_run[2]))


def test_poison_shards_become_error_rows_and_bystanders_do_not(ray_local, tiny_llama,
                                                                tmp_path):
    # shard 3 kills its actor every time; shard 4 breaks its engine every time
    write_parquet(tmp_path / "in" / "a.parquet",
                  _rows(42, special={23: "DIE-ALWAYS", 30: "RAISE"}))
    res = run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out", max_shard_attempts=2),
                  actor_cls=FakeActor, progress=False)
    out = read_output(tmp_path / "out")
    failed = out.filter(out.column("finish_reason").to_numpy(zero_copy_only=False) == "error")
    assert sorted(set(failed.column("id").to_pylist())) == list(range(21, 35))
    for row in failed.to_pylist():
        shard = row["id"] // 7
        assert row["error"].startswith(f"row id {row['id']} (shard {shard}): shard failed "
                                       "after 2 attempts, last: ")
    assert res.shards_failed == 2 and res.errors == failed.num_rows == 14
    good = out.filter(out.column("finish_reason").to_numpy(zero_copy_only=False) != "error")
    assert sorted(set(good.column("id").to_pylist())) == [*range(21), *range(35, 42)]


def test_finished_job_is_not_rerun_and_killed_job_resumes(ray_local, tiny_llama, tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(35))
    config = _config(tiny_llama, tmp_path / "in", tmp_path / "out")
    run_job(config, actor_cls=FakeActor, progress=False)
    out = tmp_path / "out"
    before = part_stats(out)
    again = run_job(config, actor_cls=FakeActor, progress=False)
    assert again.shards_skipped == again.shards == 5 and part_stats(out) == before
    assert again.rows == sum(_n(i) for i in range(35))

    manifest = read_manifest(out)
    for shard in ("1", "3"):  # as if the driver died before these commits
        del manifest["committed"][shard]
    (out / MANIFEST).write_bytes(manifest_bytes(manifest))
    (out / SUCCESS).unlink()
    (out / "part-00003.parquet").unlink()
    (out / ".part-00001-1.parquet.tmp").write_bytes(b"half a file")
    res = run_job(config, actor_cls=FakeActor, progress=False)
    after = part_stats(out)
    assert res.shards_skipped == 3
    for name in ("part-00000.parquet", "part-00002.parquet", "part-00004.parquet"):
        assert after[name] == before[name]
    assert after["part-00001.parquet"] != before["part-00001.parquet"]
    assert not (out / ".part-00001-1.parquet.tmp").exists()
    assert read_output(out).num_rows == res.rows == sum(_n(i) for i in range(35))


def test_unwritable_part_fails_the_job_clearly_and_resumes(ray_local, tiny_llama, tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(21))
    out = tmp_path / "out"
    (out / "part-00001.parquet" / "blocker").mkdir(parents=True)  # the rename cannot land
    config = _config(tiny_llama, tmp_path / "in", out)
    with pytest.raises(OSError, match="output: shard 1: cannot write .*part-00001.parquet"):
        run_job(config, actor_cls=FakeActor, progress=False)
    committed = read_manifest(out)["committed"]
    assert "1" not in committed and not (out / SUCCESS).exists()
    (out / "part-00001.parquet" / "blocker").rmdir()
    (out / "part-00001.parquet").rmdir()
    res = run_job(config, actor_cls=FakeActor, progress=False)
    assert res.shards_skipped == len(committed)
    assert read_output(out).num_rows == res.rows == sum(_n(i) for i in range(21))


def test_actor_that_cannot_start_fails_the_job(ray_local, tiny_llama, tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", _rows(7))
    with pytest.raises(RuntimeError, match="actor-0 failed to start: RuntimeError: cannot load "
                                           "the model on this worker"):
        run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out"), actor_cls=BrokenActor,
                progress=False)


def test_shard_queued_on_an_actor_that_dies_while_starting_is_not_an_attempt(
        ray_local, tiny_llama, tmp_path, caplog):
    """Each first actor gets a shard with its constructor call; one dies in its constructor:
    that shard goes back to the queue uncounted, and the job's output is the clean one."""
    import logging

    write_parquet(tmp_path / "in" / "a.parquet", _rows(21))
    token = tmp_path / "die-token"
    token.write_text("one death while starting")
    caplog.set_level(logging.WARNING, logger="jobs.dispatch")
    res = run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out"),
                  actor_cls=dies_while_starting(str(token)), progress=False)
    assert not token.exists(), "no actor died while starting"
    assert any("died while starting" in r.getMessage() for r in caplog.records)
    committed = read_manifest(tmp_path / "out")["committed"]
    assert sorted(map(int, committed)) == [0, 1, 2]
    assert all(entry["attempt"] == 1 for entry in committed.values()), committed
    assert res.shards_retried == 0 and res.errors == 0
    assert read_output(tmp_path / "out").num_rows == res.rows == sum(_n(i) for i in range(21))


def _peaks(directory) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


@pytest.mark.parametrize("deterministic", [False, True])
def test_small_shards_that_share_the_engine_fill_it(ray_local, tiny_llama, tmp_path, caplog,
                                                    deterministic):
    """4-row shards, an engine of 16 sequences: shared shards (deterministic: false) keep
    16 rows and a shard to spare on the actor, so its engine runs full; deterministic shards
    run one at a time (two calls on the actor, the engine never above one shard's rows), and
    the driver says how to fill the engine."""
    import logging

    from tests.jobs.fakes import recording

    rows = [{"id": i, "prompt": f"prompt number {i}",
             "sampling_params": json.dumps({"max_tokens": 6})} for i in range(96)]
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    (tmp_path / "peaks").mkdir()
    caplog.set_level(logging.WARNING, logger="jobs.runner")
    res = run_job(_config(tiny_llama, tmp_path / "in", tmp_path / "out", num_actors=1,
                          rows_per_shard=4, engine={"max_num_seqs": 16},
                          deterministic=deterministic),
                  actor_cls=recording(str(tmp_path / "peaks")), progress=False)
    assert res.rows == 96 and res.errors == 0 and res.shards == 24
    assert sorted(read_output(tmp_path / "out").column("id").to_pylist()) == list(range(96))
    [peak] = _peaks(tmp_path / "peaks")
    notes = [r.getMessage() for r in caplog.records if "runs alone" in r.getMessage()]
    if deterministic:
        assert peak["peak_calls"] <= 2 and peak["peak_active"] <= 4
        assert len(notes) == 1 and "rows_per_shard=4" in notes[0] and \
            "max_num_seqs=16" in notes[0] and "rows_per_shard of 16 or more" in notes[0]
    else:
        # (16 + 4) / 4 = 5 shards on the actor: two alone would hold 8 rows
        assert peak["peak_calls"] == 5
        assert 16 <= peak["peak_active"] <= 20
        assert not notes
