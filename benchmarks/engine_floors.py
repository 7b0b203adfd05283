"""The floors an engine run is measured against: the device's measured ceilings (bf16 matmul
rate, copy bandwidth), a workload's compute and decode-memory floors, and its matmuls timed
alone at the engine's row counts (with the KV reads: the serial floor); ``median_s`` times
any call (CUDA events on the GPU, the host clock elsewhere)."""

from __future__ import annotations

import time

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NOMINAL = {"matmul_tflops": 790.0, "copy_gbps": 4300.0}  # H200 figures measured here before


def median_s(fn, reps: int, device: str = DEVICE) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one untimed call: CUDA events on
    the GPU, the host clock elsewhere."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_ceilings(device: str = DEVICE) -> dict:
    """bf16 matmul rate (TFLOP/s) and device copy bandwidth (GB/s, read + write); nominal
    H200 figures off CUDA."""
    if device != "cuda":
        return dict(NOMINAL, nominal=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)

    tflops = 2 * 8192 ** 3 / median_s(lambda: a @ b, 10) / 1e12
    gbps = 2 * x.numel() / median_s(lambda: y.copy_(x), 10) / 1e9
    del a, b, x, y
    return {"matmul_tflops": tflops, "copy_gbps": gbps}


def floors(spec: dict, n: int, prompt: int, out: int, ceil: dict) -> dict:
    """Compute floor of the workload and memory floor of its decode steps (seconds)."""
    h, layers, vocab = spec["hidden_size"], spec["num_hidden_layers"], spec["vocab_size"]
    kv, heads = spec["num_key_value_heads"], spec["num_attention_heads"]
    d = h // heads
    layer_params = 2 * h * h + 2 * h * kv * d + 3 * h * spec["intermediate_size"]
    flop_tok = 2 * layers * layer_params
    ctx = n * (prompt * (prompt + 1) / 2 + out * prompt + out * (out - 1) / 2)  # keys seen
    attn = 4 * layers * heads * d * ctx
    flops = flop_tok * n * (prompt + out - 1) + 2 * h * vocab * n * out + attn
    weight_bytes = 2 * (layers * layer_params + h * vocab)  # LM head read each step
    kv_bytes = 2 * 2 * layers * kv * d * (n * (out - 1) * prompt + n * (out - 1) * out / 2)
    return {"compute_s": flops / (ceil["matmul_tflops"] * 1e12),
            "decode_memory_s": ((out - 1) * weight_bytes + kv_bytes) / (ceil["copy_gbps"] * 1e9),
            "kv_read_s": kv_bytes / (ceil["copy_gbps"] * 1e9)}


def matmul_floor(spec: dict, n: int, prompt: int, out: int, step_tokens: int,
                 device: str = "cuda") -> dict:
    """Seconds the workload's matmuls alone take at cuBLAS's speed for their own shapes.

    A layer's projections are timed with ``F.linear`` back to back, as a forward runs them,
    over several copies of the layer's weights (more than the L2 holds), at the row counts the
    engine runs them with: prefill chunks of ``step_tokens`` prompt tokens, ``out - 1`` decode
    steps of ``n`` rows; the LM head on ``n`` rows ``out`` times. Two layouts: ``separate``
    (q, k, v, o, gate, up, down, as the transformers modules run them) and ``fused`` (qkv and
    gate-up as one matmul each); ``matmul_s`` is the faster. With ``kv_read_s`` (the decode
    steps' KV-cache reads at the copy bandwidth) it bounds from below a run whose kernels go
    one after another on one stream; ``matmul_s`` alone bounds any run. Off CUDA (tests) the
    matmuls run in float32 and are timed with the host clock."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h, layers, vocab = spec["hidden_size"], spec["num_hidden_layers"], spec["vocab_size"]
    kv, inter = spec["num_key_value_heads"], spec["intermediate_size"]
    d = h // spec["num_attention_heads"]
    layouts = {
        "separate": [(h, h), (h, kv * d), (h, kv * d), (h, h), (h, inter), (h, inter), (inter, h)],
        "fused": [(h, h + 2 * kv * d), (h, h), (h, 2 * inter), (inter, h)]}

    def layer_s(rows: int, proj: list[tuple[int, int]]) -> float:
        layer_bytes = 2 * sum(k * m for k, m in proj)
        copies = max(2, -(-256 * 2 ** 20 // layer_bytes))
        ws = [[torch.randn(m, k, device=device, dtype=dtype) for k, m in proj]
              for _ in range(copies)]
        xs = {k: torch.randn(rows, k, device=device, dtype=dtype) for k, _ in proj}
        rounds = max(1, 32 // copies)

        def run():
            for _ in range(rounds):
                for layer in ws:
                    for (k, _), w in zip(proj, layer):
                        torch.nn.functional.linear(xs[k], w)
        return median_s(run, 5, device) / (rounds * copies)

    def head_s(rows: int) -> float:
        w = torch.randn(vocab, h, device=device, dtype=dtype)
        x = torch.randn(rows, h, device=device, dtype=dtype)
        return median_s(lambda: [torch.nn.functional.linear(x, w) for _ in range(8)], 5,
                        device) / 8

    tokens = n * prompt
    chunks = [step_tokens] * (tokens // step_tokens) + [tokens % step_tokens] * bool(
        tokens % step_tokens)
    params = layers * sum(k * m for k, m in layouts["separate"])
    flop = 2 * params * (tokens + n * (out - 1)) + 2 * n * out * h * vocab
    head = out * head_s(n)
    result: dict = {"matmul_head_s": head}
    for name, proj in layouts.items():
        per_rows = {rows: layers * layer_s(rows, proj) for rows in sorted(set(chunks + [n]))}
        prefill, decode = sum(per_rows[c] for c in chunks), (out - 1) * per_rows[n]
        total = prefill + decode + head
        result[name] = {"matmul_s": total, "prefill_s": prefill, "decode_s": decode,
                        "decode_step_ms": per_rows[n] * 1e3, "tflops": flop / total / 1e12}
        if device == "cuda":
            torch.cuda.empty_cache()
    best = min(layouts, key=lambda name: result[name]["matmul_s"])
    result.update(matmul_s=result[best]["matmul_s"], matmul_layout=best,
                  matmul_tflops_achieved=result[best]["tflops"])
    return {"matmuls": result, "matmul_s": result["matmul_s"]}
