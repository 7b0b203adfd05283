"""Smoke tests of benchmarks/determinism.py and benchmarks/rl_bench.py on the tiny model (CPU
in CI; the GPU runs are the benchmarks themselves)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.helpers import load_benchmark, written_as_returned

def test_determinism_bench_compares_alone_and_batched_probes(tmp_path, capsys):
    report = load_benchmark("determinism").main(["--workload", "tiny", "--out", str(tmp_path),
                                       "--tmp", str(tmp_path)])
    assert written_as_returned(tmp_path / "determinism.json", report)
    off, on = report["results"]
    assert (off["batch_invariant"], on["batch_invariant"]) == (False, True)
    for r in (off, on):
        assert r["batch"] == 16 and r["num_probes"] == 2 and r["batch_output_tok_s"] > 0
        for probe in r["probes"].values():
            assert probe["shared_tokens"] > 0
            # float32 on CPU: batch dependence is rounding, far below a token flip
            assert 0 <= probe["max_raw_diff"] < 1e-4
    assert "batch_invariant=True" in capsys.readouterr().out


def test_rl_bench_runs_every_mode(tmp_path):
    report = load_benchmark("rl_bench").main(["--workloads", "tiny", "--transport", "local", "--reps",
                                    "1", "--out", str(tmp_path), "--tmp", str(tmp_path)])
    assert json.loads((tmp_path / "rl_bench.json").read_text())["results"].keys() == {"tiny"}
    result = report["results"]["tiny"]
    update, sleep, parity = result["update"], result["sleep"], result["parity"]
    assert update["end_to_end_s"] > 0 and update["device_to_device_s"] > 0
    assert update["num_tensors"] > 10
    assert sleep["engine_reported_freed"]["kv_cache"] == pytest.approx(
        sleep["kv_cache_gib"] * 2**30)
    assert sleep["outputs_equal_after_level1"] and sleep["outputs_equal_after_level2"]
    assert parity["num_tokens"] == 4 * 8
    assert parity["engine_vs_hf_float32"]["max_abs_diff"] < 1e-4  # float32 on CPU
