"""Smoke test of benchmarks/structured_host_bench.py on the tiny tokenizer (CPU)."""

from __future__ import annotations

from tests.benchmarks.helpers import load_benchmark, written_as_returned


def test_tiny_run_times_every_phase_and_writes_its_json(tmp_path):
    bench = load_benchmark("structured_host_bench")
    out = tmp_path / "host.json"
    result = bench.main(["--tokenizer", "tiny", "--rows", "40", "--steps", "6",
                         "--threads", "1,2", "--reps", "1", "--out", str(out)])
    assert written_as_returned(out, result)
    first, second = result["runs"]
    assert (first["threads"], second["threads"]) == (1, 2)
    for run in result["runs"]:
        assert run["steps"] == 6
        assert all(run[k]["median_ms"] > 0 for k in ("book", "fill", "total", "serial"))
        assert run["serial"]["median_ms"] < run["total"]["median_ms"]
        # the library's own fill and accept in every matcher layout
        for layout in run["raw_fill"].values():
            assert all(layout[k] > 0 for k in ("first_ms", "after_token_ms", "accept_ms",
                                               "serial_accept_ms"))
    # the masks depend on the rows' tokens only, not on the fill threads
    assert first["mask_sha256"] == second["mask_sha256"]


def test_rows_per_template_sets_the_templates_and_is_restored():
    from actors.engine import structured_sequence

    bench = load_benchmark("structured_host_bench")
    before = structured_sequence.ROWS_PER_TEMPLATE
    result = bench.main(["--tokenizer", "tiny", "--rows", "12", "--steps", "2",
                         "--threads", "2", "--reps", "1", "--rows-per-template", "3"])
    assert structured_sequence.ROWS_PER_TEMPLATE == before
    # 12 rows, 3 a template, at most one template a fill thread: 2 templates of 6 rows
    assert result["rows_per_template"] == 3
    assert result["runs"][0]["templates"] == 2
    assert result["runs"][0]["template_max_over_mean"] == 1.0


def test_the_ahead_fill_gives_the_in_step_masks_and_times_its_wait():
    bench = load_benchmark("structured_host_bench")
    args = ["--tokenizer", "tiny", "--rows", "40", "--steps", "6", "--threads", "2",
            "--reps", "1"]
    in_step = bench.main(args)["runs"][0]
    ahead = bench.main(args + ["--ahead-host-ms", "1"])["runs"][0]
    assert ahead["mask_sha256"] == in_step["mask_sha256"]
    assert ahead["ahead"]["median_ms"] > 0 and "settle" in ahead
    assert "ahead" not in in_step and "settle" not in in_step
    assert ahead["steps"] == in_step["steps"] == 6
