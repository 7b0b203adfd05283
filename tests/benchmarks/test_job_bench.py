"""Smoke test of benchmarks/job_bench.py on the tiny model with CPU actors: the bare engine,
``raygen run`` with 1 and 2 actors, and the 2-actor run with one actor killed mid-job (the GPU
run is the benchmark itself)."""

from __future__ import annotations

import os

import pytest

from tests.benchmarks.helpers import load_benchmark, written_as_returned

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def job_bench():
    return load_benchmark("job_bench")


def test_cpu_run_checks_every_job_and_survives_a_killed_actor(job_bench, tmp_path, capsys):
    report = job_bench.main(["--model-config", "tiny", "--device", "cpu", "--rows", "64",
                             "--output-len", "32", "--rows-per-shard", "16", "--max-actors",
                             "2", "--no-overlap-run", "--repeats", "2", "--out", str(tmp_path),
                             "--tmp", str(tmp_path)])
    assert written_as_returned(tmp_path / "job_bench.json", report)
    jobs = report["jobs"]
    assert set(jobs) == {"1_actor", "2_actors", "2_actors_kill"}
    for name, job in jobs.items():
        assert job["checks"] and all(job["checks"].values()), (name, job["checks"])
        assert job["shards"] == 4 and job["output_tokens"] == 64 * 32
        assert job["output_tok_s"] > 0 and job["generation_s"] < job["end_to_end_s"]
    assert report["all_checks_passed"]
    assert jobs["2_actors"]["checks"]["identical_to_1_actor"]
    kill = jobs["2_actors_kill"]
    assert kill["killed"]["pid"] > 0 and kill["shards_retried"] >= 1
    assert kill["checks"]["same_rows_as_clean_2_actors"]
    bare = report["bare_engine"]
    assert bare["rows"] == 64 and bare["output_tokens"] == 64 * 32
    # two runs of each (fresh processes); the rows above are the median (lower middle) ones
    samples = report["repeat_tok_s"]
    assert {k: len(v) for k, v in samples.items()} == {"bare": 2, "1_actor": 2, "2_actors": 2}
    assert bare["output_tok_s"] == min(samples["bare"])
    assert jobs["1_actor"]["output_tok_s"] == min(samples["1_actor"])
    assert jobs["1_actor"]["checks"]["every_repeat"] and len(jobs["2_actors"]["repeats"]) == 2
    # the bare and 1-actor runs alternate; each pair's ratio, and the CPUs probed before/after
    pairs = report["pairs_tok_s"]
    assert sorted(b for b, _ in pairs) == sorted(samples["bare"])
    assert [j for _, j in pairs] == samples["1_actor"]
    assert report["pair_overhead"] == [b / j - 1 for b, j in pairs]
    probe = report["cpu_probe_ms"]
    assert set(probe["before"]) == set(probe["after"]) == set(os.sched_getaffinity(0))
    assert all(v > 0 for v in probe["before"].values())
    for name, job in jobs.items():  # every shard is counted once, by the actor that wrote it
        shards = sorted(i for a in job["per_actor"].values() for i in a["shards"])
        assert shards == [0, 1, 2, 3] or name == "2_actors_kill", (name, job["per_actor"])
        # each committed shard's mean batch, from its line (16-row shards run alone)
        assert set(job["shard_batches"]) >= {str(i) for i in shards}, job["shard_batches"]
        assert all(1 <= b <= 16 for b in job["shard_batches"].values()), job["shard_batches"]
    assert jobs["2_actors"]["sum_of_actor_tok_s"] > 0
    assert jobs["1_actor"]["token_ids_equal_bare"] == 1.0  # float32 on CPU: no near-ties
    assert "all checks passed" in capsys.readouterr().out


def test_input_rows_mix_params_and_fit_the_output_schema(job_bench, tmp_path):
    import pyarrow.parquet as pq

    job_bench.write_input(tmp_path / "in.parquet", 24, 8, 512)
    table = pq.read_table(tmp_path / "in.parquet")
    assert table.num_rows == 24 and table.column_names == [
        "id", "prompt_token_ids", "sampling_params", "group"]
    params = table.column("sampling_params").to_pylist()
    assert {p["logprobs"] for p in params} == {None, 0, 5, 20}
    assert {p["temperature"] for p in params} >= {0.0, 0.8, 1.0}
    assert sum(p["seed"] is not None for p in params) == 6
    assert all(len(ids) == 8 for ids in table.column("prompt_token_ids").to_pylist())
    assert load_benchmark("job_rows").expected_schema().names[-1] == "group"


def test_actor_windows_count_each_actor_from_its_own_start(job_bench):
    events = [(1.0, "actor-0", "ready", -1), (2.0, "actor-1", "ready", -1),
              (3.0, "actor-0", "shard", 0), (4.5, "actor-1", "shard", 2),
              (4.0, "actor-0", "shard", 1),
              (5.0, "actor-1", "ready", -1), (7.0, "actor-1", "shard", 3)]  # restarted
    windows = job_bench.actor_windows(events, lambda shard: 100 * (shard + 1))
    assert windows["actor-0"] == {"ready_s": 1.0, "shards": [0, 1], "output_tokens": 300,
                                  "last_commit_s": 4.0, "window_s": 3.0, "output_tok_s": 100.0}
    assert windows["actor-1"]["shards"] == [3] and windows["actor-1"]["window_s"] == 2.0
    assert windows["actor-1"]["output_tok_s"] == 200.0


def test_cpu_choice_takes_the_fastest_or_a_list(job_bench):
    speeds = {0: 9.0, 1: 21.0, 2: 8.5, 3: 9.0, 4: 30.0}
    assert job_bench.choose_cpus("fastest:2", speeds) == [0, 2]  # a tie goes to the lower id
    assert job_bench.choose_cpus("fastest:5", speeds) == [0, 1, 2, 3, 4]
    assert job_bench.choose_cpus("0,2-3", speeds) == [0, 2, 3]
    with pytest.raises(SystemExit, match="fastest:N"):
        job_bench.choose_cpus("fastest:6", speeds)


def test_the_probe_pins_each_cpu_and_restores_the_affinity(job_bench):
    allowed = os.sched_getaffinity(0)
    speeds = job_bench.probe_cpus(rounds=1)
    assert set(speeds) == allowed and all(v > 0 for v in speeds.values())
    assert os.sched_getaffinity(0) == allowed


def test_half_a_gpu_per_actor_runs_two_actors_on_one_gpu(job_bench, tmp_path):
    assert [job_bench.actors_that_fit(g, 1.0) for g in (0, 1, 2, 8)] == [1, 1, 2, 2]
    assert [job_bench.actors_that_fit(g, 0.5) for g in (0, 1, 2)] == [1, 2, 2]
    assert job_bench.actors_that_fit(1, 0.4) == 2 and job_bench.actors_that_fit(1, 0.6) == 1
    args = type("Args", (), {"model_config": "tiny", "prompt_len": 8, "output_len": 8,
                             "max_num_seqs": 0, "max_batched_tokens": 0, "device": "auto",
                             "gpus_per_actor": 0.5, "rows_per_shard": 16, "text": False})()
    config = job_bench.job_config(args, tmp_path, tmp_path / "out", 2, True)
    assert config["num_gpus_per_actor"] == 0.5 and config["num_actors"] == 2
    args.device = "cpu"
    assert job_bench.job_config(args, tmp_path, tmp_path / "out", 2, True)[
        "num_gpus_per_actor"] == 0
    for bad in ("0", "1.5", "-1"):
        with pytest.raises(SystemExit):
            job_bench.main(["--gpus-per-actor", bad, "--out", str(tmp_path)])


def test_text_runs_detokenize_in_the_bare_engine_and_the_job(job_bench, tmp_path):
    report = job_bench.main(["--model-config", "tiny", "--device", "cpu", "--rows", "32",
                             "--output-len", "8", "--rows-per-shard", "16", "--max-actors", "1",
                             "--no-overlap-run", "--text", "--out", str(tmp_path),
                             "--tmp", str(tmp_path)])
    job = report["jobs"]["1_actor"]
    assert job["checks"]["text_where_asked"] and all(job["checks"].values()), job["checks"]
    assert report["job_config"]["sampling_params"]["detokenize"] is True
