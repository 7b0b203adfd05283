"""benchmarks/startup_bench.py: the startup timeline read from a job's log, and a CPU run."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from tests.benchmarks.helpers import load_benchmark

@pytest.fixture(scope="module")
def startup_bench():
    return load_benchmark("startup_bench")


def test_the_timeline_reads_the_plan_ray_and_each_actors_first_ready(startup_bench):
    log = [(0.5, "INFO jobs.runner: 4 shards planned, 0 already committed"),
           (1.0, "INFO jobs.cluster: starting a local Ray on 127.0.0.1"),
           (4.5, "INFO jobs.cluster: Ray ready in 3.5 s"),
           (15.0, "INFO jobs.dispatch: actor-0 ready (startup: process age 12.5 s, engine "
                  "import 2.0 s, build transformers import 3.9 s, build cuda graphs 1.3 s)"),
           (16.2, "INFO jobs.dispatch: actor-1 ready (startup: process age 13.1 s, engine "
                  "import 2.2 s)"),
           (29.0, "INFO jobs.runner: job finished: 64 rows (0 errors), 512 output tokens"),
           (30.0, "INFO jobs.dispatch: actor-1 ready (startup: process age 14.0 s)")]  # again
    t = startup_bench.timeline(log)
    assert t["planned_s"] == 0.5 and t["ray_start_s"] == 1.0 and t["ray_ready_s"] == 4.5
    assert t["actors"]["actor-0"] == {"ready_s": 15.0, "process age": 12.5,
                                      "engine import": 2.0, "build transformers import": 3.9,
                                      "build cuda graphs": 1.3}
    assert t["actors"]["actor-1"]["process age"] == 13.1  # a restart is not the startup
    assert t["first_ready_s"] == 15.0 and t["ready_skew_s"] == pytest.approx(1.2)
    assert t["ray_to_ready_s"] == pytest.approx(10.5)  # the actors' part, after Ray's start
    assert t["finished_s"] == 29.0
    assert startup_bench.timeline(log[:2] + log[3:])["ray_to_ready_s"] is None  # no Ray ready
    runs = [{"tree": "a", "end_to_end_s": e, "planned_s": 1.0, "ray_ready_s": r,
             "first_ready_s": f, "ray_to_ready_s": f - r, "ready_skew_s": 0.0,
             "actors": {"actor-0": {"process age": age}}}
            for e, r, f, age in ((30.0, 5.0, 20.0, 15.0), (25.0, 4.0, 16.0, 12.0),
                                 (27.0, 3.0, 18.0, 13.0))]
    summary = startup_bench.summarize(runs, [Path("a")])["a"]
    # the first run (it fills the bytecode cache) is left out of the medians
    ray_fields = {f for f, _, _ in startup_bench.RAY_EVENTS}
    assert {k: v for k, v in summary.items() if k not in ray_fields} == {
        "runs": 2, "planned_s": 1.0, "ray_ready_s": 3.5, "first_ready_s": 17.0,
        "ray_to_ready_s": 13.5, "ready_skew_s": 0.0, "process_age_at_ready_s": 12.5,
        "finished_s": None, "end_to_end_s": 26.0}
    assert all(summary[f] is None for f in ray_fields)  # no session logs read


def test_rays_start_is_read_from_its_session_logs(startup_bench, tmp_path):
    logs = tmp_path / "session_x" / "logs"
    logs.mkdir(parents=True)
    files = {
        "gcs_server.out": "[2026-12-05 00:11:13,262 I 5545 5545] (gcs_server) main.cc:98: up",
        "dashboard.log": "2026-12-05 00:11:13,931\tINFO utils.py:319 -- modules",
        "raylet.out": "[2026-12-05 00:11:14,353 I 1 1] (raylet) main.cc:283: cluster ID\n"
                      "no stamp here\n"
                      "[2026-12-05 00:11:15,290 I 1 1] (raylet) node_manager.cc:355: Raylet "
                      "of id, 7550 started.",
        "dashboard_agent.log": "2026-12-05 00:11:15,054\tINFO agent.py:177 -- grpc",
        "runtime_env_agent.log": "2026-12-05 00:11:15,027\tINFO runtime_env_agent.py:356 -- up",
        "python-core-driver-01_5538.log": "[2026-12-05 00:11:15,458 I 5538 5538] core worker",
        "python-core-worker-aa_5721.log": "[2026-12-05 00:11:16,919 I 5721 5721] core worker",
        "python-core-worker-bb_5722.log": "[2026-12-05 00:11:15,919 I 5722 5722] core worker",
    }
    for name, text in files.items():
        (logs / name).write_text(text + "\n")
    started = datetime.datetime(2026, 12, 5, 0, 11, 12).timestamp() + 0.5
    log = [(0.1, "INFO jobs.cluster: starting a local Ray on 127.0.0.1"),
           (9.0, f"log:     {logs}/raygen-20261205-001115-5538.log")]
    assert startup_bench.session_logs(log) == logs
    assert startup_bench.session_logs(log[:1]) is None
    t = startup_bench.ray_timeline(logs, started)
    assert t == pytest.approx({"ray_gcs_s": 0.762, "ray_api_server_s": 1.431,
                               "ray_raylet_start_s": 1.853, "ray_dashboard_agent_s": 2.554,
                               "ray_runtime_env_agent_s": 2.527,
                               "ray_raylet_ready_s": 2.79, "ray_driver_s": 2.958,
                               "ray_first_worker_s": 3.419})
    (logs / "raylet.out").write_text("[2026-12-05 00:11:14,353 I 1 1] (raylet) starting\n")
    assert "ray_raylet_ready_s" not in startup_bench.ray_timeline(logs, started)


@pytest.mark.ray
@pytest.mark.slow
def test_a_cpu_run_reports_each_actors_startup(startup_bench, tmp_path, capsys):
    report = startup_bench.main(["--model-config", "tiny", "--device", "cpu", "--rows", "16",
                                 "--repeats", "1", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "startup_bench.json").read_text())["runs"] == report["runs"]
    (run,) = report["runs"]
    assert run["returncode"] == 0 and list(run["actors"]) == ["actor-0"]
    actor = run["actors"]["actor-0"]
    assert 0 < run["planned_s"] < run["ray_ready_s"] < run["first_ready_s"] == actor["ready_s"] \
        < run["end_to_end_s"]
    assert actor["process age"] > 0 and "build transformers import" in actor
    assert run["first_ready_s"] < run["finished_s"] < run["end_to_end_s"]
    assert run["ray_to_ready_s"] == pytest.approx(run["first_ready_s"] - run["ray_ready_s"])
    # Ray's start from its session logs, in the order its processes come up (ms stamps)
    assert 0 < run["ray_gcs_s"] <= run["ray_raylet_start_s"] <= run["ray_raylet_ready_s"] \
        <= run["ray_driver_s"] <= run["ray_first_worker_s"] < run["first_ready_s"]
    assert run["ray_gcs_s"] <= run["ray_api_server_s"]
    assert "ray_dashboard_agent_s" in run and "ray_runtime_env_agent_s" in run
    assert "startup_bench" in capsys.readouterr().out


def test_a_directory_that_is_no_checkout_is_refused(startup_bench, tmp_path):
    with pytest.raises(SystemExit):
        startup_bench.main(["--trees", str(tmp_path), "--out", str(tmp_path)])
