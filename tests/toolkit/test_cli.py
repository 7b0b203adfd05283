"""``raygen run``: job-level errors end with one clear message before Ray or a model starts."""

from __future__ import annotations

import pytest
import yaml

import jobs.cluster
from tests.jobs.helpers import write_parquet
from toolkit.cli import build_parser, main


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the driver gets as far as connecting to Ray."""
    def connect(address):
        raise AssertionError("the job reached Ray although its config is bad")

    monkeypatch.setattr(jobs.cluster, "connect", connect)


def _run(tmp_path, capsys, **config) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["run", str(path), "--no-progress"])
    return code, capsys.readouterr().err


def _good(tmp_path, model) -> dict:
    write_parquet(tmp_path / "in.parquet", [{"id": 1, "prompt": "hi"}])
    return {"model": model, "input": str(tmp_path / "in.parquet"),
            "output": str(tmp_path / "out"), "num_gpus_per_actor": 0}


@pytest.mark.parametrize("change,message", [
    ({"num_actor": 2}, "config: unknown key 'num_actor' (did you mean 'num_actors'?)"),
    ({"engine": {"max_num_seq": 8}}, "config.engine: unknown option(s) 'max_num_seq'"),
    ({"engine": {"dtype": "float8"}}, "config.engine.dtype: must be one of"),
    ({"sampling_params": {"top_p": 2}}, "sampling_params.top_p: must be in (0, 1]"),
    ({"model": "/no/such/model"}, "config.model: '/no/such/model' does not exist"),
    ({"input": "/no/such/input.parquet"}, "input: '/no/such/input.parquet' does not exist"),
    ({"prompt_column": "text"}, "has none of the prompt columns 'text', 'messages'"),
])
def test_bad_job_fails_before_ray(tmp_path, capsys, tiny_llama, no_ray, change, message):
    code, err = _run(tmp_path, capsys, **{**_good(tmp_path, tiny_llama), **change})
    assert code == 1
    assert err.startswith("raygen: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unwritable_output_fails_before_ray(tmp_path, capsys, tiny_llama, no_ray):
    (tmp_path / "a-file").write_text("x")
    code, err = _run(tmp_path, capsys, **{**_good(tmp_path, tiny_llama),
                                          "output": str(tmp_path / "a-file" / "out")})
    assert code == 1 and "raygen: error: output: cannot use" in err


def test_other_config_in_the_same_output_is_refused(tmp_path, capsys, tiny_llama, no_ray):
    from jobs.config import load_config
    from jobs.sources import discover
    from jobs.manifest import Manifest
    from jobs.plan import plan_document, plan_shards
    from jobs.storage import resolve

    good = _good(tmp_path, tiny_llama)
    cfg = load_config(good)
    spec = discover(cfg)
    Manifest.open(resolve(cfg.output), cfg.output_identity(),
                  plan_document(spec, plan_shards(spec, cfg.rows_per_shard), cfg.rows_per_shard))
    code, err = _run(tmp_path, capsys, **{**good, "seed": 5})
    assert code == 1 and "different configuration (differs in: seed);" in err


def test_missing_config_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 1
    assert "config: cannot read" in capsys.readouterr().err


def test_parser_knows_every_command():
    parser = build_parser()
    assert parser.parse_args(["run", "j.yaml"]).command == "run"
    args = parser.parse_args(["submit", "j.yaml", "--address", "http://h:1", "--wait"])
    assert (args.address, args.wait) == ("http://h:1", True)
    assert parser.parse_args(["status", "raysubmit_1", "--logs"]).logs
    assert parser.parse_args(["demo"]).output == "demo-out"
    with pytest.raises(SystemExit):
        parser.parse_args(["explode"])
