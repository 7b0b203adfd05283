"""Smoke test of benchmarks/decode_attention_bench.py on its tiny shape (the kernel under the
CPU interpreter in CI; the GPU run is the benchmark itself)."""

from __future__ import annotations

from tests.benchmarks.helpers import load_benchmark, written_as_returned


def test_tiny_sweep_checks_every_tile_and_writes_json(tmp_path):
    bench = load_benchmark("decode_attention_bench")
    result = bench.main(["--shapes", "tiny", "--quick", "--out", str(tmp_path)])
    assert written_as_returned(tmp_path / "decode_attention_bench.json", result)
    tiny = result["shapes"]["tiny"]
    sweep = tiny["sweep"]
    assert len(sweep) == 8  # 2 blocks x 2 warp counts x 2 stage counts, one chunk
    # every tile computes the engine tile's result (the same keys in the same order per block)
    assert all(r["max_abs_diff"] < 1e-2 for r in sweep)
    assert tiny["best"]["us"] == min(r["us"] for r in sweep)
    assert tiny["engine_tile_us"] in [r["us"] for r in sweep]
    assert all(r["eager_us"] > 0 for r in sweep)  # the launch-by-launch figure beside it
    rows, _, kv_heads, dim, lo, hi = bench.SHAPES["tiny"]
    # the floor: the rows' K and V bytes at the measured copy rate
    assert 0 < tiny["kv_read_floor_us"] <= rows * hi * kv_heads * dim * 4 / (
        result["copy_tbps"] * 1e12) * 1e6 * (1 + 1e-9)
    assert tiny["flashinfer_us"] is None or tiny["flashinfer_us"] > 0


def test_pages_of_gives_each_row_its_context(tmp_path):
    bench = load_benchmark("decode_attention_bench")
    pages, indptr, indices, last, kv_bytes = bench.pages_of(5, 2, 8, 3, 40, bench._device())
    counts = (indptr[1:] - indptr[:-1]).cpu()
    lengths = (counts - 1) * bench.BLOCK_SIZE + last.cpu()
    assert bool(((lengths >= 3) & (lengths <= 40)).all())
    assert sorted(indices.cpu().tolist()) == list(range(pages.shape[0]))  # each page once
    assert kv_bytes == int(lengths.sum()) * 2 * 8 * 2 * 2
