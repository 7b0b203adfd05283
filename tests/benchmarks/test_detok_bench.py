"""Smoke test of benchmarks/detok_bench.py on the tiny tokenizer (CPU)."""

from __future__ import annotations

from tests.benchmarks.helpers import load_benchmark, written_as_returned


def test_tiny_run_times_both_ways_with_equal_texts(tmp_path):
    bench = load_benchmark("detok_bench")
    out = tmp_path / "detok.json"
    results = bench.main(["--tokenizer", "tiny", "--rows", "24", "--steps", "12",
                          "--repeats", "1", "--stop-rows", "0.5", "--out", str(out)])
    assert written_as_returned(out, results)
    assert [r["stream"] for r in results] == ["text", "random"]
    for result in results:
        assert result["rows"] == 24 and result["steps"] == 12 and result["chars"] > 0
        assert result["ms_per_step"] > 0 and result["ms_per_step_decoding"] > 0
        assert len(result["runs"]["pieces"]) == len(result["runs"]["decoding"]) == 1
