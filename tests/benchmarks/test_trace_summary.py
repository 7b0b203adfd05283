"""benchmarks/trace_summary.py on a made-up timeline."""

from __future__ import annotations

import json

from tests.benchmarks.helpers import load_benchmark


def test_batches_split_into_prefill_and_decode_steps_and_shard_work_beside_them(tmp_path,
                                                                               capsys):
    # a batch from t=10 to t=11: two prefill steps, then four decode steps of 1,024 rows;
    # the next shard's rows are read during the first decode step only
    steps = [(10.10, 0.10, 0.02, 0.07, 32768), (10.20, 0.10, 0.01, 0.09, 32768),
             (10.21, 0.010, 0.002, 0.007, 1024), (10.22, 0.010, 0.001, 0.009, 1024),
             (10.23, 0.010, 0.000, 0.010, 1024), (10.24, 0.010, 0.001, 0.008, 1024),
             (12.00, 0.010, 0.000, 0.010, 1024)]  # after the batch: not counted
    events = [("prepare", "Dummy-1", 10.205, 10.207, 1), ("prefetch", "shard-prefetch", 9, 10.1, 0),
              ("gc", "engine-loop", 10.5, 10.503, 0, 10), ("batch", "engine-loop", 10.0, 11.0, 1024)]
    (tmp_path / "trace-7.json").write_text(json.dumps({"pid": 7, "steps": steps,
                                                       "events": events}))
    records = load_benchmark("trace_summary").main([str(tmp_path), "--json"])
    [batch] = records["batches"]["trace-7.json"]
    assert batch["decode_steps"] == 4 and batch["prefill_steps"] == 2
    assert batch["prefill_host_s"] == 0.17
    assert batch["decode_host_ms"] == 9.0 and batch["decode_cpu_ms"] == 8.5
    assert batch["decode_wait_ms"] == 1.0
    assert batch["decode_steps_beside_shard_work"] == 1  # the prefetch does not count
    assert batch["gc_ms"] == 3.0 and batch["seconds"] == 1.0
    assert json.loads(capsys.readouterr().out) == records


def test_process_view_counts_each_step_once_across_overlapping_batches(tmp_path):
    # two shards sharing the engine: batches [10, 10.4] and [10.1, 10.5] overlap; one prefill
    # step ran while the other shard's part was written (its CPU time below its host time)
    steps = [(10.05, 0.05, 0.000, 0.050, 2048),   # prefill, alone
             (10.20, 0.10, 0.000, 0.040, 4096),   # prefill, beside the write: 60 ms not running
             (10.21, 0.01, 0.002, 0.008, 256), (10.22, 0.01, 0.001, 0.009, 256),
             (10.60, 0.01, 0.000, 0.010, 256)]    # after both batches: not counted
    events = [("batch", "engine-loop", 10.0, 10.4, 128), ("batch", "engine-loop", 10.1, 10.5, 128),
              ("write", "Dummy-2", 10.12, 10.18, 0), ("prefetch", "shard-prefetch", 9.0, 10.3, 1)]
    (tmp_path / "trace-9.json").write_text(json.dumps({"pid": 9, "steps": steps,
                                                       "events": events}))
    records = load_benchmark("trace_summary").main([str(tmp_path), "--json"])
    proc = records["processes"]["trace-9.json"]
    assert proc["seconds"] == 0.5 and proc["shard_work_s"] == 0.06  # the prefetch does not count
    assert proc["prefill"] == {"steps": 2, "tokens": 6144, "busy_s": 0.15, "host_s": 0.15,
                               "cpu_s": 0.09, "not_running_s": 0.06, "beside_shard_work": 1}
    assert proc["decode"]["steps"] == 2 and proc["decode"]["not_running_s"] == 0.0
    assert proc["decode"]["host_s"] == 0.017 and proc["decode"]["beside_shard_work"] == 0
    # the per-batch view counts the shared steps in both batches
    first, second = records["batches"]["trace-9.json"]
    assert first["prefill_steps"] == 2 and second["prefill_steps"] == 1
