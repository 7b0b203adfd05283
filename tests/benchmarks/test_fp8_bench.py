"""Smoke test of benchmarks/fp8_bench.py on a tiny model (CPU: the FP8 engine's device check is
taken out, torch emulates the FP8 matmuls; the GPU run is the benchmark itself)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def fp8_bench():
    return load_benchmark("fp8_bench")


def test_tiny_workload_compares_fp8_fp8_kv_bf16_and_fp32_and_writes_json(fp8_bench, tmp_path,
                                                                   monkeypatch, capsys):
    from actors.engine.model.quantization import fp8_model

    monkeypatch.setattr(fp8_model, "check_fp8_device", lambda device, dtype: None)
    results = fp8_bench.main(["--workloads", "tiny", "--out", str(tmp_path), "--tmp",
                              str(tmp_path), "--max-batched-tokens", "64",
                              "--quality-tokens", "6", "--kv-fp8"])
    saved = json.loads((tmp_path / "fp8_bench.json").read_text())
    assert saved["results"] == json.loads(json.dumps(results))
    (r,) = results
    bf16, fp8 = r["bf16"]["throughput"], r["fp8"]["throughput"]
    assert bf16["output_tokens"] == fp8["output_tokens"] == r["num_prompts"] * r["output_len"]
    assert r["speedup"] == pytest.approx(fp8["output_tok_s"] / bf16["output_tok_s"])
    assert r["fp8"]["quantization"]["fp8_layers"] == 14 and r["bf16"]["quantization"] is None
    assert r["quality_prompts"] == 8 and r["quality_tokens"] == 6
    for key in ("greedy_fp8_vs_bf16", "greedy_fp32_vs_bf16"):
        assert 0 <= r[key]["identical"] <= r[key]["num_prompts"] == 8
    for key in ("logprob_fp8_vs_bf16", "logprob_bf16_vs_fp32", "logprob_fp8_vs_fp32"):
        d = r[key]
        assert 0 <= d["mean_abs"] <= d["p99_abs"] <= d["max_abs"]
    assert r["logprob_fp8_vs_bf16"]["max_abs"] > 0  # FP8 is another model
    kv = r["fp8_kv"]  # FP8 weights and an FP8 KV cache (--kv-fp8)
    assert kv["kv_cache_dtype"] == "float8_e4m3fn" and r["fp8"]["kv_cache_dtype"] == "bfloat16"
    assert kv["quantization"]["fp8_layers"] == 14 and "update_weights" not in kv
    assert kv["throughput"]["output_tokens"] == bf16["output_tokens"]
    assert r["speedup_fp8_kv"] == pytest.approx(kv["throughput"]["output_tok_s"]
                                                / bf16["output_tok_s"])
    assert 0 <= r["greedy_fp8_kv_vs_bf16"]["identical"] <= 8
    assert r["logprob_fp8_kv_vs_bf16"]["max_abs"] > 0
    for side in ("bf16", "fp8"):
        assert r[side]["update_weights"]["seconds"] > 0
        assert r[side]["update_weights"]["num_tensors"] > 0
    printed = capsys.readouterr().out
    assert "tiny" in printed and "fp8+kv" in printed


def test_layer_kernels_times_every_piece(fp8_bench):
    pytest.importorskip("triton")
    r = fp8_bench.layer_kernels(fp8_bench.TINY, rows=5, device="cpu", reps=1)
    assert r["rows"] == 5
    for key in ("projections_bf16_ms", "projections_fp8_ms", "projections_fp8_promoted_accum_ms",
                "rms_norm_ms", "rms_norm_fp8_ms",
                "silu_mul_ms", "silu_mul_fp8_ms", "quantize_rows_ms"):
        assert r[key] > 0
    assert r["projections_speedup"] == pytest.approx(r["projections_bf16_ms"]
                                                     / r["projections_fp8_ms"])


def test_agreement_and_drift_definitions(fp8_bench):
    same = fp8_bench.agreement([[1, 2, 3], [1, 2, 4], [9, 2, 3]], [[1, 2, 3]] * 3)
    assert same == {"identical": 1, "num_prompts": 3,
                    "mean_shared_prefix": pytest.approx((1 + 2 / 3 + 0) / 3)}
    d = fp8_bench.drift(np.array([[-1.0, -2.0]]), np.array([[-1.5, -2.0]]))
    assert d["mean_abs"] == 0.25 and d["max_abs"] == 0.5


def test_bad_arguments_are_refused(fp8_bench, tmp_path):
    with pytest.raises(SystemExit):
        fp8_bench.main(["--workloads", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        fp8_bench.main(["--quality-prompts", "0", "--out", str(tmp_path)])
