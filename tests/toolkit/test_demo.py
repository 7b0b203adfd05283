"""``raygen demo`` as a user runs it: the console script, a fresh cache, a local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.manifest import SUCCESS
from sampler import SamplingParams
from benchmarks.job_processes import process_tree
from tests.jobs.helpers import is_loopback, listening_addresses
from toolkit.demo import demo_prompts

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_bundled_prompts_are_valid():
    table = pq.read_table(demo_prompts())
    assert {"id", "prompt", "messages", "sampling_params", "topic"} <= set(table.column_names)
    kinds = {("prompt" if r["prompt"] is not None else "messages") for r in table.to_pylist()}
    assert kinds == {"prompt", "messages"}
    params = [SamplingParams.coerce(p) for p in table.column("sampling_params").to_pylist()]
    assert {p.n for p in params} == {1, 2} and any(p.stop for p in params)
    assert any(p.logprobs is not None for p in params) and any(p.seed for p in params)


def test_demo_runs_and_prints_summary_and_rows(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "raygen")
    assert os.path.exists(script), "the raygen console script is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAYGEN_CACHE"] = str(tmp_path / "cache")
    demo = subprocess.Popen([script, "demo", "--output", str(tmp_path / "demo-out")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 400
    while demo.poll() is None and time.monotonic() < deadline:
        seen.update(listening_addresses(process_tree(demo.pid)))  # the demo's own Ray
        time.sleep(0.5)
    stdout, stderr = demo.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert demo.returncode == 0, stderr[-3000:]
    assert seen and all(is_loopback(a) for a in seen), seen

    prompts = pq.read_table(demo_prompts()).to_pylist()
    total = sum(SamplingParams.coerce(r["sampling_params"]).n for r in prompts)
    assert f"rows:    {total} output rows for {len(prompts)} input rows, 0 errors" in stdout
    assert "output tokens/s" in stdout
    # every actor of the demo's pool (2, or 1 on a one-CPU machine) is listed, with 0% if the
    # other took every shard while it was still loading; the shares (each rounded to 1%) add
    # up to 100%
    actors = [line for line in stdout.splitlines() if line.startswith("actors:  ")]
    assert len(actors) == 1, stdout
    shares = dict(item.rsplit(" ", 1) for item in actors[0][len("actors:  "):].split(", "))
    pool = max(1, min(2, os.cpu_count() or 1))
    assert sorted(shares) == [f"actor-{i}" for i in range(pool)], actors[0]
    assert all(v.endswith("%") for v in shares.values()), actors[0]
    assert abs(sum(int(v[:-1]) for v in shares.values()) - 100) <= 1, actors[0]
    shown = [line for line in stdout.splitlines() if line.startswith("  demo-")]
    assert len(shown) == 8 and shown[0].startswith("  demo-00[0] ")

    out = pq.read_table(tmp_path / "demo-out")
    assert out.num_rows == total and out.column("error").null_count == out.num_rows
    assert out.schema.field("seed").type == pa.int64()
    assert sorted(set(out.column("id").to_pylist())) == sorted(r["id"] for r in prompts)
    assert out.column("topic").to_pylist().count("chat") >= 4
    assert (tmp_path / "cache" / "tiny-llama" / "raygen_tiny.json").exists()
    assert (tmp_path / "demo-out" / SUCCESS).exists()

    # quiet: the summary, the rows and the startup/progress lines; no INFO records, no colour
    # codes (output is not a terminal), no per-actor weight-loading bars, no Ray auth-token
    # warning, no nanobind leak dump at actor exit; the details are in the log file
    both = stdout + stderr
    for noise in ("INFO ", "\x1b[", "Loading weights", "Writing model shards",
                  "Token authentication", "nanobind", "shard 0 by"):
        assert noise not in both, (noise, both[-3000:])
    progress = [line for line in stderr.splitlines() if line.strip()]
    assert progress[0] == f"raygen: starting actors 0/{pool}", stderr
    assert f"raygen: actors ready {pool}/{pool}" in progress, stderr
    assert progress[-1].startswith("raygen: 12/12 rows"), stderr
    [log_line] = [line for line in stdout.splitlines() if line.startswith("log:     ")]
    log = open(log_line.split(maxsplit=1)[1]).read()
    assert "shard 0 by actor-" in log and "ready (startup: process age" in log, log[-3000:]
