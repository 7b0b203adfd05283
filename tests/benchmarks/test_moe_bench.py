"""Smoke test of benchmarks/moe_bench.py on tiny MoE models (CPU in CI; the GPU run is the
benchmark itself), and its floors."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def moe_bench():
    return load_benchmark("moe_bench")


def test_tiny_models_run_both_paths_and_write_json(moe_bench, tmp_path, capsys):
    results = moe_bench.main(["--models", "tiny-qwen3-moe,tiny-mixtral", "--out", str(tmp_path),
                              "--tmp", str(tmp_path), "--prompt-len", "12",
                              "--output-len", "5", "--max-batched-tokens", "64"])
    saved = json.loads((tmp_path / "moe_bench.json").read_text())
    assert saved["results"] == json.loads(json.dumps(results))
    for r in results:
        hf, fused = r["hf"], r["fused"]
        assert hf["fused_moe"] is None  # the HF modules
        assert fused["fused_moe"]["experts"] == fused["fused_moe"]["routers"] == 2
        assert not fused["fused_moe"]["kept"]
        stats = fused["batches"]["6"]
        assert stats["output_tok_s"] == pytest.approx(6 * 5 / stats["elapsed_s"])
        summary = r["summary"]["6"]
        assert summary["tok_s_speedup"] == pytest.approx(
            stats["output_tok_s"] / hf["batches"]["6"]["output_tok_s"])
    assert "tiny-mixtral" in capsys.readouterr().out


def test_floors_of_the_qwen3_30b_a3b_shape(moe_bench):
    spec = moe_bench.QWEN3_30B_A3B
    f512 = moe_bench.floors(spec, 512, 128)
    # 512 rows x 8 of 128 experts: essentially every expert of every layer is read
    assert f512["experts_touched_per_layer"] == pytest.approx(128, abs=1e-6)
    experts_bytes = 48 * 128 * 3 * 2048 * 768 * 2
    assert f512["expert_read_floor_ms"] == pytest.approx(experts_bytes / 4.16e12 * 1e3)
    one = moe_bench.floors(spec, 1, 128)
    assert one["experts_touched_per_layer"] == pytest.approx(8)
    f1024 = moe_bench.floors(spec, 1024, 128)
    assert f1024["expert_read_floor_ms"] == pytest.approx(f512["expert_read_floor_ms"])
    # prefill FLOPs grow with the prompts (linear parts) and their attention
    assert f1024["prefill_matmul_floor_s"] == pytest.approx(2 * f512["prefill_matmul_floor_s"])
