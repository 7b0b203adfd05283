"""submit_job to a ``ray start --head`` cluster on 127.0.0.1 (token auth), ``raygen status``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from benchmarks.job_processes import process_tree
from tests.jobs.helpers import (is_loopback, listening_addresses, write_jsonl,
                                write_parquet)
from tests.toolkit.cluster import head_cluster
from toolkit.cli import main
from toolkit.submit import _portable_config, job_status, submit_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_portable_config_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    cfg = _portable_config({"model": "model", "input": ["in/a.jsonl", "s3://bucket/b.parquet"],
                            "output": "out", "ray_address": "auto"})
    assert cfg["model"] == str(tmp_path / "model") and cfg["output"] == str(tmp_path / "out")
    assert cfg["input"] == [str(tmp_path / "in/a.jsonl"), "s3://bucket/b.parquet"]
    assert cfg["ray_address"] is None
    with pytest.raises(ValueError, match="unknown key 'modle'"):
        _portable_config({"modle": "x", "input": "a", "output": "o"})


def test_submit_to_a_cluster_and_status(tmp_path, monkeypatch, tiny_llama, capsys):
    monkeypatch.chdir(tmp_path)
    write_parquet(tmp_path / "in" / "a.parquet",
                  [{"id": i, "prompt": f"hello number {i}"} for i in range(10)])
    write_jsonl(tmp_path / "in" / "b.jsonl",
                [{"id": 10 + i, "prompt": "more words", "sampling_params": {"n": 2}}
                 for i in range(4)])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "model": tiny_llama, "input": "in", "output": "out", "num_actors": 1,
        "num_gpus_per_actor": 0, "rows_per_shard": 5, "sampling_params": {"max_tokens": 3},
        "engine": {"max_num_seqs": 16, "max_model_len": 64, "num_kv_blocks": 64}}))
    with head_cluster() as cluster:
        addresses = listening_addresses(process_tree(cluster.process.pid))
        assert addresses and all(is_loopback(a) for a in addresses), addresses
        with pytest.raises(PermissionError, match="refused the request: it needs its auth"):
            submit_job("job.yaml", cluster.url, token="not-the-token")
        with monkeypatch.context() as no_token:  # no token anywhere: a clear refusal too
            for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
                no_token.delenv(name, raising=False)
            no_token.setenv("HOME", str(tmp_path / "home"))
            with pytest.raises(PermissionError,
                               match=r"needs its auth token \(none was found\); pass token= "
                                     r"or set RAY_AUTH_TOKEN"):
                submit_job("job.yaml", cluster.url)
            assert main(["submit", "job.yaml", "--address", cluster.url]) == 1
            err = capsys.readouterr().err
            assert err.startswith("raygen: error: Ray at ") and "none was found" in err, err
            assert "pass --token or set RAY_AUTH_TOKEN" in err and "token=" not in err, err
        job_id = submit_job("job.yaml", cluster.url, token=cluster.token)
        deadline = time.monotonic() + 300
        status = job_status(job_id, cluster.url, token=cluster.token)
        while not status.finished and time.monotonic() < deadline:
            time.sleep(1)
            status = job_status(job_id, cluster.url, token=cluster.token)
        assert status.status == "SUCCEEDED", status.logs[-3000:]
        assert "14 input rows, 0 errors" in status.logs
        cli = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "raygen"), "status", job_id,
             "--address", cluster.url, "--token", cluster.token],
            capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.startswith(f"{job_id}: SUCCEEDED")
        missing = subprocess.run(
            [sys.executable, "-m", "toolkit.cli", "status", "no-such-job",
             "--address", cluster.url, "--token", cluster.token],
            capture_output=True, text=True, timeout=60)
        assert missing.returncode == 1 and "no-such-job" in missing.stderr
        # a second job, stopped at once: `raygen stop`, then `raygen list` shows both
        other = submit_job({**yaml.safe_load((tmp_path / "job.yaml").read_text()),
                            "output": "out-stopped"}, cluster.url, token=cluster.token)
        auth = ["--address", cluster.url, "--token", cluster.token]
        assert main(["stop", other, *auth]) == 0
        assert capsys.readouterr().out.startswith(f"{other}: stopping")
        deadline = time.monotonic() + 120
        while not job_status(other, cluster.url, token=cluster.token).finished:
            assert time.monotonic() < deadline
            time.sleep(1)
        assert job_status(other, cluster.url, token=cluster.token).status == "STOPPED"
        assert main(["list", *auth]) == 0
        listed = capsys.readouterr().out.splitlines()
        assert [line.split()[:2] for line in listed] == [[job_id, "SUCCEEDED"],
                                                          [other, "STOPPED"]], listed
        assert listed[0].endswith(str(tmp_path / "out"))
        tree = process_tree(cluster.process.pid)
    assert cluster.process.returncode is not None
    # the head's children exit on their own once it is gone: give a loaded machine time
    deadline = time.monotonic() + 20
    while (left := _ray_processes(tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"cluster processes left: {left}"
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 10 + 4 * 2
    assert sorted(set(table.column("id").to_pylist())) == list(range(14))


def _ray_processes(pids) -> list[int]:
    """Those of ``pids`` still running a Ray process."""
    left = []
    for pid in pids:
        try:
            if "ray" in Path(f"/proc/{pid}/cmdline").read_text():
                left.append(pid)
        except OSError:  # gone
            continue
    return left
