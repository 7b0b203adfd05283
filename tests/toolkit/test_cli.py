"""``raygen run``: job-level errors end with one clear message before Ray or a model starts."""

from __future__ import annotations

import sys

import pytest
import yaml

import jobs.cluster
import toolkit.cli
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
    assert parser.parse_args(["list", "--all"]).all
    assert parser.parse_args(["stop", "raysubmit_1", "--token", "t"]).job_id == "raysubmit_1"
    batch = parser.parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"])
    assert (batch.input, batch.output, batch.model) == ("in.jsonl", "out.jsonl", "m")
    with pytest.raises(SystemExit):
        parser.parse_args(["explode"])


def test_version(capsys):
    from toolkit import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"raygen {__version__}\n"


def test_set_overrides_are_yaml_typed_and_dotted():
    from jobs.config import JobConfig, apply_overrides

    data = apply_overrides({"model": "m", "input": "i", "output": "o",
                            "sampling_params": {"temperature": 0.5}},
                           ["sampling_params.max_tokens=64", "num_actors=4",
                            "engine.max_num_seqs=8", "sampling_params.stop=[a, b]",
                            "trust_remote_code=true", "ray_address=null", "output=out/x"])
    cfg = JobConfig.from_dict(data)
    assert cfg.sampling_params == {"temperature": 0.5, "max_tokens": 64, "stop": ["a", "b"]}
    assert (cfg.num_actors, cfg.engine, cfg.trust_remote_code, cfg.ray_address, cfg.output) \
        == (4, {"max_num_seqs": 8}, True, None, "out/x")
    with pytest.raises(ValueError, match=r"--set 'num_actors': expected key=value"):
        apply_overrides({}, ["num_actors"])
    with pytest.raises(ValueError, match=r"config.num_actors: --set num_actors.x: num_actors "
                                         r"is not a mapping"):
        apply_overrides({"num_actors": 2}, ["num_actors.x=1"])


@pytest.mark.parametrize("sets,message", [
    (["num_actor=2"], "config: unknown key 'num_actor' (did you mean 'num_actors'?)"),
    (["num_actors=two"], "config.num_actors: must be an integer, got 'two'"),
    (["sampling_params.top_p=2"], "sampling_params.top_p: must be in (0, 1]"),
    (["engine.max_num_seq=8"], "config.engine: unknown option(s) 'max_num_seq'"),
])
def test_set_is_validated_like_the_file(tmp_path, capsys, tiny_llama, no_ray, sets, message):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_good(tmp_path, tiny_llama)))
    args = ["run", str(path), "--no-progress"]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("raygen: error: ") and message in err, err


def test_output_option_overrides_the_file(tmp_path, tiny_llama, monkeypatch):
    from jobs.config import load_config
    from toolkit import cli

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_good(tmp_path, tiny_llama)))
    args = build_parser().parse_args(["run", str(path), "--output", str(tmp_path / "o2"),
                                      "--set", "sampling_params.max_tokens=64"])
    cfg = load_config(cli._config_data(args))
    assert cfg.output == str(tmp_path / "o2") and cfg.sampling_params == {"max_tokens": 64}


def test_run_help_lists_the_config_keys(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for key in ("--set KEY=VALUE", "model", "rows_per_shard", "default 1000",
                "write_sampling_params", "sampling_params.<field>", "engine.<field>"):
        assert key in out, key


def test_quiet_by_default_and_details_with_verbose(capsys, tmp_path):
    import logging

    from toolkit import logs

    for level, shown in ((logging.WARNING, False), (logging.INFO, True)):
        with logs.configured(level) as handler:
            logging.getLogger("jobs.runner").info("shard 0 by actor-0: details")
            logging.getLogger("jobs.progress").info("4/12 rows")
            logging.getLogger("jobs.dispatch").warning("actor-0 lost")
            path = handler.path
        err = capsys.readouterr().err
        assert ("shard 0 by actor-0" in err) is shown
        assert "raygen: 4/12 rows" in err and "WARNING jobs.dispatch: actor-0 lost" in err
        assert "shard 0 by actor-0: details" in open(path).read()


class _FakeRay:
    def __init__(self, connected: bool):
        self.connected = connected
        self.shutdowns = 0

    def is_initialized(self) -> bool:
        return self.connected

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.connected = False


@pytest.mark.parametrize("connected_before,code,ended", [
    (False, 0, True),   # the run opened the session and finished: it ends now
    (True, 0, False),   # a session the caller holds is left to the caller
    (False, 1, False),  # a failed run leaves the ending to the exit (late worker lines)
])
def test_a_finished_run_ends_the_ray_session_it_opened(monkeypatch, connected_before, code,
                                                      ended):
    fake = _FakeRay(connected_before)
    monkeypatch.setitem(sys.modules, "ray", fake)

    def run(args):
        fake.connected = True  # the run connects (or finds the caller's session)
        return code

    monkeypatch.setattr(toolkit.cli, "_cmd_run", run)
    assert main(["run", "job.yaml", "--no-progress"]) == code
    assert fake.shutdowns == int(ended) and fake.connected is not ended
