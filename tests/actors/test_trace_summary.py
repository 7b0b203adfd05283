"""benchmarks/trace_summary.py on a made-up timeline."""

from __future__ import annotations

import json

from tests.actors.helpers import load_benchmark


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
    [batch] = records["trace-7.json"]
    assert batch["decode_steps"] == 4 and batch["prefill_steps"] == 2
    assert batch["prefill_host_s"] == 0.17
    assert batch["decode_host_ms"] == 9.0 and batch["decode_cpu_ms"] == 8.5
    assert batch["decode_wait_ms"] == 1.0
    assert batch["decode_steps_beside_shard_work"] == 1  # the prefetch does not count
    assert batch["gc_ms"] == 3.0 and batch["seconds"] == 1.0
    assert json.loads(capsys.readouterr().out) == records
