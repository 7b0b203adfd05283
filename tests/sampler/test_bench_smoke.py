"""benchmarks/sampler_bench.py runs end to end on a tiny grid and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sampler_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sampler_bench.py"), "--device", "cpu",
         "--batch-sizes", "1,3", "--vocab-sizes", "97", "--iters", "2", "--warmup", "1",
         "--backends", "torch", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    data = json.loads(out.read_text())
    records = [r for r in data["records"] if r["backend"] == "torch"]
    workloads = ("greedy", "greedy_sampled_logprob", "greedy_logprobs", "top_p", "mixed", "full")
    assert {(r["workload"], r["batch"]) for r in records} == {
        (w, b) for w in workloads for b in (1, 3)}
    assert all(r["median_ms"] > 0 and r["iters"] == 2 and r["vocab"] == 97 for r in records)
    assert data["meta"]["device"] == "cpu"
    for workload in ("greedy_logprobs", "full"):
        assert workload in run.stdout


def test_sampler_bench_triton_variants_under_the_interpreter(tmp_path):
    """The default kernels and the fused kernel alone (``a``: no candidate path) through the
    bench's variant grammar (Triton's CPU interpreter: correctness of the plumbing, not
    speed)."""
    import os

    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sampler_bench.py"), "--device", "cpu",
         "--batch-sizes", "3", "--vocab-sizes", "97", "--iters", "1", "--warmup", "0",
         "--backends", "triton,triton@64x4a", "--workloads", "full,top_p",
         "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    records = json.loads(out.read_text())["records"]
    assert {(r["backend"], r["workload"]) for r in records if r.get("median_ms", 0) > 0} == {
        (b, w) for b in ("triton", "triton@64x4a") for w in ("full", "top_p")}


def test_sampler_bench_device_slots_and_chunk_sizes(tmp_path):
    """``--device-slots`` (the step's slots also passed as a device copy, as the engine does)
    and the greedy split's chunk size in the variant grammar (``kBxWxC``), under the
    interpreter."""
    import os

    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sampler_bench.py"), "--device", "cpu",
         "--batch-sizes", "3", "--vocab-sizes", "97", "--iters", "1", "--warmup", "0",
         "--backends", "triton,triton@64x4k32x4x64", "--workloads", "greedy_sampled_logprob",
         "--device-slots", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    records = json.loads(out.read_text())["records"]
    assert {(r["backend"], r["slots"]) for r in records if r.get("median_ms", 0) > 0} == {
        ("triton", "device"), ("triton@64x4k32x4x64", "device")}


def test_kernel_resources_compiles_for_sm90():
    """benchmarks/kernel_resources.py builds a kernel for sm_90 on a machine without a GPU and
    reads its registers and spill bytes (compiled Triton: not under the interpreter)."""
    import os
    import re

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--only",
         "rank"], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    found = re.search(r"^rank +4 warps +REG:(\d+) STACK:(\d+)$", run.stdout, re.M)
    assert found, run.stdout
    assert 0 < int(found[1]) <= 255 and int(found[2]) >= 0
