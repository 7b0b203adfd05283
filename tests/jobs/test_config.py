"""JobConfig: defaults, dict and YAML forms, typos and wrong types rejected by name."""

from __future__ import annotations

import pytest

from jobs.config import JobConfig, load_config

BASE = {"model": "m", "input": "in.parquet", "output": "out"}


def test_defaults_follow_the_design():
    cfg = JobConfig.from_dict(BASE)
    assert (cfg.id_column, cfg.prompt_column, cfg.messages_column, cfg.token_ids_column,
            cfg.params_column) == ("id", "prompt", "messages", "prompt_token_ids",
                                   "sampling_params")
    assert (cfg.num_actors, cfg.num_gpus_per_actor, cfg.seed, cfg.max_shard_attempts) == (1, 1,
                                                                                          0, 3)
    assert cfg.ray_address is None and cfg.trust_remote_code is False
    assert cfg.deterministic is True
    assert cfg.sampling_params == {} and cfg.engine == {} and cfg.inputs == ["in.parquet"]


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown key 'num_actor' \(did you mean 'num_actors'"):
        JobConfig.from_dict({**BASE, "num_actor": 2})


def test_missing_required_key():
    with pytest.raises(ValueError, match=r"config.output: required key is missing"):
        JobConfig.from_dict({"model": "m", "input": "x"})


@pytest.mark.parametrize("key,value,match", [
    ("num_actors", 0, r"config.num_actors: must be >= 1, got 0"),
    ("num_actors", "2", r"config.num_actors: must be an integer"),
    ("num_gpus_per_actor", -1, r"config.num_gpus_per_actor: must be a number >= 0"),
    ("rows_per_shard", 2.5, r"config.rows_per_shard: must be an integer"),
    ("seed", -3, r"config.seed: must be in \[0, "),
    ("max_shard_attempts", 0, r"config.max_shard_attempts"),
    ("input", [], r"config.input"),
    ("input", ["a", ""], r"config.input: every entry"),
    ("model", "", r"config.model: must be a non-empty string"),
    ("engine", [1], r"config.engine: must be a mapping"),
    ("trust_remote_code", "yes", r"config.trust_remote_code: must be true or false"),
    ("deterministic", 1, r"config.deterministic: must be true or false"),
    ("prompt_column", "id", r"config.prompt_column: must differ"),
    ("sampling_params", {"temperature": -1}, r"sampling_params.temperature: must be >= 0"),
    ("sampling_params", {"best_of": 2}, r"sampling_params.best_of"),
    ("sampling_params", {"tempature": 1}, r"unknown field 'tempature'"),
])
def test_bad_values_name_the_field(key, value, match):
    with pytest.raises(ValueError, match=match):
        JobConfig.from_dict({**BASE, key: value})


def test_yaml_round_trip_and_safe_load(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: m\ninput: [a.parquet, b.jsonl]\noutput: out\nnum_actors: 2\n"
                    "sampling_params: {max_tokens: 8, temperature: 0.5}\n")
    cfg = load_config(path)
    assert cfg.inputs == ["a.parquet", "b.jsonl"] and cfg.num_actors == 2
    assert cfg.sampling_params == {"max_tokens": 8, "temperature": 0.5}
    assert load_config(str(path)) == cfg and load_config(cfg.to_dict()) == cfg
    evil = tmp_path / "evil.yaml"
    evil.write_text("model: !!python/object/apply:os.system ['echo hi']\ninput: x\noutput: o\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(evil)


def test_yaml_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(TypeError):
        load_config(42)


def test_identity_ignores_how_the_job_runs():
    a = JobConfig.from_dict({**BASE, "num_actors": 1, "max_shard_attempts": 3})
    b = JobConfig.from_dict({**BASE, "num_actors": 4, "max_shard_attempts": 5,
                             "ray_address": "auto", "num_gpus_per_actor": 0})
    assert a.fingerprint() == b.fingerprint()
    c = JobConfig.from_dict({**BASE, "seed": 1})
    d = JobConfig.from_dict({**BASE, "sampling_params": {"max_tokens": 17}})
    assert len({a.fingerprint(), c.fingerprint(), d.fingerprint()}) == 3


def test_example_job_yaml_is_valid():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "job.yaml")
    assert cfg.num_actors == 2 and cfg.sampling_params["max_tokens"] == 256


def test_rows_an_actor_holds_in_shards_that_share_its_engine():
    from jobs.plan import fill_rows, underfilled_engine

    base = {"model": "m", "input": "x", "output": "o", "rows_per_shard": 10}
    assert fill_rows(JobConfig.from_dict(base)) == 0  # deterministic: one shard at a time
    shared = {**base, "deterministic": False}
    assert fill_rows(JobConfig.from_dict(shared)) == 256 + 10  # the engine's default seqs
    assert fill_rows(JobConfig.from_dict({**shared, "engine": {"max_num_seqs": 64},
                                          "sampling_params": {"n": 3}})) == 22 + 10
    note = underfilled_engine(JobConfig.from_dict({**base, "sampling_params": {"n": 2}}), 500)
    assert "rows_per_shard=10 at most 10 rows x n=2" in note
    assert "max_num_seqs=256" in note and "rows_per_shard of 128 or more" in note
    assert underfilled_engine(JobConfig.from_dict(base), 10) is None  # one shard: no larger
    assert underfilled_engine(JobConfig.from_dict(shared), 500) is None
    tiny = {**shared, "rows_per_shard": 2, "engine": {"max_num_seqs": 100}}
    note = underfilled_engine(JobConfig.from_dict(tiny), 500)  # 32 shards of 2 rows: 64
    assert "holds at most 32 shards, so with rows_per_shard=2 at most 64 rows" in note
    assert "max_num_seqs=100" in note and "rows_per_shard of 4 or more" in note
    assert underfilled_engine(JobConfig.from_dict(tiny), 64) is None  # no more rows to hold
    assert underfilled_engine(JobConfig.from_dict({**base, "rows_per_shard": 256}), 500) is None
