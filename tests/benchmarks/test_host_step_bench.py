"""Smoke test of benchmarks/host_step_bench.py (a small batch)."""

from __future__ import annotations

from tests.benchmarks.helpers import load_benchmark


def test_host_step_bench_times_each_phase_for_both_mixes(capsys):
    results = load_benchmark("host_step_bench").main(["--batch", "16", "--output-len", "10"])
    assert set(results) == {"top_p", "job"}
    for phases in results.values():
        assert set(phases) == {"schedule", "prepare", "process"}
        assert all(0 < ms < 1000 for ms in phases.values())
    out = capsys.readouterr().out
    assert "job    batch 16:" in out and "per decode step" in out


def test_host_step_bench_structured_mix_runs_constrained_rows():
    results = load_benchmark("host_step_bench").main(["--batch", "8", "--output-len", "10",
                                                      "--mix", "structured"])
    assert set(results) == {"structured"}
    assert set(results["structured"]) == {"schedule", "prepare", "process", "step_mask",
                                          "advance"}
    assert all(0 < ms < 1000 for ms in results["structured"].values())


def test_host_step_bench_waves_time_the_admissions_and_the_rows_ending(capsys):
    results = load_benchmark("host_step_bench").main(["--batch", "16", "--output-len", "10",
                                                      "--mix", "top_p", "--waves"])
    waves = results["waves"]
    assert waves["admit_steps"] == 1  # 16 prompts of 128 tokens: one 32,768-token step
    assert waves["finish_steps"] == 4  # max_tokens 10, 9, 8, 7: four steps where rows end
    assert all(0 < waves[k] < 1e4 for k in ("admit_ms", "admit_us_per_seq", "finish_ms",
                                            "finish_us_per_seq", "first_launch_ms"))
    assert "waves  batch 16: admission" in capsys.readouterr().out
