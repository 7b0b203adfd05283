"""Smoke test of benchmarks/e2e_bench.py on a tiny model (CPU in CI; the GPU run is the
benchmark itself)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def e2e_bench():
    return load_benchmark("e2e_bench")


def test_tiny_workload_runs_both_sides_and_writes_json(e2e_bench, tmp_path, capsys):
    results = e2e_bench.main(["--workloads", "tiny", "--out", str(tmp_path),
                              "--tmp", str(tmp_path), "--max-batched-tokens", "64"])
    saved = json.loads((tmp_path / "e2e_bench.json").read_text())
    assert saved["results"] == json.loads(json.dumps(results))
    (r,) = results
    n, out = r["num_prompts"], r["output_len"]
    assert r["engine"]["output_tok_s"] == pytest.approx(n * out / r["engine"]["elapsed_s"])
    assert r["hf"]["output_tok_s"] == pytest.approx(n * out / r["hf"]["elapsed_s"])
    assert r["speedup"] == pytest.approx(r["hf"]["elapsed_s"] / r["engine"]["elapsed_s"])
    assert r["compute_s"] > 0 and r["decode_memory_s"] > 0
    assert "tiny" in capsys.readouterr().out


def test_floors_scale_with_the_workload(e2e_bench):
    ceil = {"matmul_tflops": 100.0, "copy_gbps": 1000.0}
    small = e2e_bench.floors(e2e_bench.QWEN2_05B, 512, 128, 128, ceil)
    big = e2e_bench.floors(e2e_bench.QWEN2_05B, 1024, 128, 128, ceil)
    assert big["compute_s"] == pytest.approx(2 * small["compute_s"])
    # decode memory: weights once per step (shared), KV per sequence
    assert small["decode_memory_s"] < big["decode_memory_s"] < 2 * small["decode_memory_s"]


def test_the_job_mix_runs_the_engine_with_job_bench_params(e2e_bench, tmp_path, monkeypatch):
    import benchmarks.job_rows as job_rows

    asked = []
    row_params = job_rows.row_params
    monkeypatch.setattr(job_rows, "row_params", lambda i: asked.append(i) or row_params(i))
    (r,) = e2e_bench.main(["--workloads", "tiny", "--out", str(tmp_path), "--tmp", str(tmp_path),
                           "--skip-hf", "--mix", "job", "--max-batched-tokens", "64"])
    assert r["mix"] == "job" and "hf" not in r
    assert asked == list(range(r["num_prompts"]))  # one job row's params per prompt
    assert r["engine"]["output_tok_s"] == pytest.approx(
        r["num_prompts"] * r["output_len"] / r["engine"]["elapsed_s"])


def test_matmul_floor_times_both_layouts_at_the_engines_row_counts(e2e_bench, monkeypatch):
    rows_seen = []
    linear = e2e_bench.torch.nn.functional.linear
    monkeypatch.setattr(e2e_bench.torch.nn.functional, "linear",
                        lambda x, w: rows_seen.append((x.shape[0], w.shape)) or linear(x, w))
    spec = e2e_bench.TINY
    # 8 prompts of 16 tokens in chunks of 48: prefill rows 48, 48, 32; decode rows 8
    r = e2e_bench.matmul_floor(spec, 8, 16, 8, 48, device="cpu")
    m = r["matmuls"]
    assert {rows for rows, _ in rows_seen} == {48, 32, 8}
    h, inter = spec["hidden_size"], spec["intermediate_size"]
    kv_width = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    # the fused layout's gate-up and qkv, the separate one's k / v, the LM head
    assert {tuple(w) for _, w in rows_seen} >= {(2 * inter, h), (h + 2 * kv_width, h),
                                                 (kv_width, h), (spec["vocab_size"], h)}
    for layout in ("separate", "fused"):
        t = m[layout]
        assert t["matmul_s"] == pytest.approx(t["prefill_s"] + t["decode_s"] + m["matmul_head_s"])
        assert t["decode_s"] == pytest.approx(7 * t["decode_step_ms"] / 1e3)
    assert r["matmul_s"] == min(m["separate"]["matmul_s"], m["fused"]["matmul_s"])
    assert m["matmul_layout"] in ("separate", "fused")
    assert r["matmul_s"] == m[m["matmul_layout"]]["matmul_s"]


def test_floors_only_measures_no_model(e2e_bench, tmp_path):
    (r,) = e2e_bench.main(["--workloads", "tiny", "--out", str(tmp_path), "--floors-only"])
    assert "engine" not in r and "hf" not in r and r["compute_s"] > 0 and r["kv_read_s"] > 0
    saved = json.loads((tmp_path / "e2e_bench.json").read_text())
    assert saved["results"] == json.loads(json.dumps([r]))


def test_repeat_runs_time_the_same_run_again_on_the_warm_engine(e2e_bench, tmp_path):
    (r,) = e2e_bench.main(["--workloads", "tiny", "--out", str(tmp_path), "--tmp", str(tmp_path),
                           "--skip-hf", "--max-batched-tokens", "64", "--repeat-runs", "2"])
    runs = r["engine"]["repeat_runs"]
    assert len(runs) == 2
    for run in runs:
        assert run["elapsed_s"] > 0
        assert run["output_tok_s"] == pytest.approx(
            r["num_prompts"] * r["output_len"] / run["elapsed_s"])
