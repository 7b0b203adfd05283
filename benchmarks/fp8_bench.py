"""FP8 against bf16: engine throughput, logprob drift and update_weights time, one run.

    python benchmarks/fp8_bench.py --out /tmp/fp8                      # H200: both workloads
    python benchmarks/fp8_bench.py --workloads qwen2-0.5b-128 --no-fp32

Per workload (models built on the GPU with random bf16 weights, as in e2e_bench.py):

- throughput: the same prompts (every request at once, fixed output length, EOS ignored,
  T=0.8 / top-p 0.95) through a bf16 engine and an FP8 engine (``quantization: fp8``), output
  tok/s of each and their ratio; with ``--kv-fp8`` also a third engine, FP8 weights and an FP8
  KV cache (``kv_cache_dtype: fp8``), with the same measures as the FP8 engine (key
  ``fp8_kv``);
- quality, on ``--quality-prompts`` prompts: greedy outputs of the FP8 (and fp32) engine
  against the bf16 engine's (identical outputs, mean shared prefix); and the raw logprobs the
  three engines give to the same tokens (each prompt + the bf16 engine's greedy output,
  scored with ``prompt_logprobs``): mean / max |FP8 - bf16| and |bf16 - fp32| over the output
  positions (docs/fp8.md defines them);
- update_weights: the checkpoint's bf16 tensors (host memory) pushed into each engine, seconds
  (the FP8 engine re-quantizes them on the device);
- on CUDA, ms per pure-decode step of each engine (``StepTimer``) and the pieces of one layer
  at the decode batch and at one prefill step: the seven projections in bf16 (``F.linear``)
  and in FP8 (``_scaled_mm``), and the bf16 / FP8 variants of the fused norm and SiLU kernels
  with the standalone quantization.

JSON lands in ``--out``/fp8_bench.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_bench import LLAMA3_8B, QWEN2_05B, TINY, build_model, frozen_heap  # noqa: E402
from engine_floors import median_s  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKLOADS = {  # name: (model config, prompts, prompt length, output length)
    "tiny": (TINY, 8, 16, 8),  # a smoke test of the script
    "llama3-8b-256": (LLAMA3_8B, 512, 256, 256),
    "qwen2-0.5b-128": (QWEN2_05B, 1024, 128, 128),
}
TEMPERATURE, TOP_P = 0.8, 0.95


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()  # the runner and its CUDA graphs reference each other
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def engine_options(n: int, model_len: int, dtype: str, quantization: str | None,
                   args, kv_cache_dtype: str = "auto") -> dict:
    return {"dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
            "max_num_seqs": n,
            "max_num_batched_tokens": args.max_batched_tokens, "max_model_len": model_len,
            "enable_prefix_caching": False, "gpu_memory_utilization": args.memory}


def throughput(engine, prompts: np.ndarray, out: int) -> dict:
    from sampler import SamplingParams

    n = len(prompts)
    params = [SamplingParams(max_tokens=out, ignore_eos=True, temperature=TEMPERATURE,
                             top_p=TOP_P, seed=i, detokenize=False) for i in range(n)]
    engine.generate([(f"w{i}", prompts[i, :16].tolist(), params[i].replace(max_tokens=8))
                     for i in range(min(4, n))])  # warm-up
    timer = None
    if DEVICE == "cuda":
        from actors.engine.step_timer import StepTimer

        timer = StepTimer().attach(engine)
    with frozen_heap():
        sync()
        t0 = time.perf_counter()
        outs = engine.generate([(i, prompts[i].tolist(), params[i]) for i in range(n)])
        sync()
        elapsed = time.perf_counter() - t0
    tokens = sum(o.num_output_tokens for o in outs)
    result = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed}
    if timer is not None:
        summary = timer.summary()
        timer.detach()
        result.update({k: summary.get(k) for k in ("decode_steps", "ms_per_decode_step",
                                                   "gpu_ms_per_step", "idle_fraction")})
    return result


def layer_kernels(spec: dict, rows: int, device: str = DEVICE, reps: int = 20) -> dict:
    """Milliseconds of one decoder layer's pieces at ``rows`` tokens: the projections in bf16
    and FP8 (weights already quantized), and the norm / SiLU / quantize kernels (CUDA events;
    elsewhere the host clock, the tests' smoke run)."""
    from actors.engine.model.kernels.fp8_quant import quantize_rows
    from actors.engine.model.kernels.rms_norm import rms_norm, rms_norm_fp8
    from actors.engine.model.kernels.silu_mul import silu_mul, silu_mul_fp8
    from actors.engine.model.quantization.fp8_linear import Fp8Linear

    h, inter = spec["hidden_size"], spec["intermediate_size"]
    kv = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    dt = torch.bfloat16
    linears = [torch.nn.Linear(k, n, bias=False, device=device, dtype=dt).requires_grad_(False)
               for k, n in shapes]
    fp8 = [Fp8Linear.from_linear(lin) for lin in linears]
    xs = {k: torch.randn(rows, k, device=device, dtype=dt) for k in (h, inter)}
    qs = {k: quantize_rows(x) for k, x in xs.items()}
    w = torch.ones(h, device=device, dtype=dt)
    gate, up = xs[inter], xs[inter].clone()

    def ms(fn) -> float:
        return median_s(fn, reps, device) * 1e3

    out = {
        "rows": rows,
        "projections_bf16_ms": ms(lambda: [torch.nn.functional.linear(xs[k], lin.weight)
                                           for (k, _), lin in zip(shapes, linears)]),
        "projections_fp8_ms": ms(lambda: [layer.matmul(*qs[k])
                                          for (k, _), layer in zip(shapes, fp8)]),
        # the engine's GEMMs accumulate fast (fp8_linear.FAST_ACCUM); this is what periodic
        # promotion of the partial sums to float32 would cost instead
        "projections_fp8_promoted_accum_ms": ms(lambda: [
            torch._scaled_mm(qs[k][0], layer.weight.t(), scale_a=qs[k][1],
                             scale_b=layer.weight_scale, out_dtype=dt, use_fast_accum=False)
            for (k, _), layer in zip(shapes, fp8)]),
        "rms_norm_ms": ms(lambda: rms_norm(xs[h], w, 1e-6)),
        "rms_norm_fp8_ms": ms(lambda: rms_norm_fp8(xs[h], w, 1e-6)),
        "silu_mul_ms": ms(lambda: silu_mul(gate, up)),
        "silu_mul_fp8_ms": ms(lambda: silu_mul_fp8(gate, up)),
        "quantize_rows_ms": ms(lambda: quantize_rows(xs[h])),
    }
    out["projections_speedup"] = out["projections_bf16_ms"] / out["projections_fp8_ms"]
    return out


def greedy(engine, prompts: np.ndarray, out: int) -> list[list[int]]:
    params = {"max_tokens": out, "temperature": 0.0, "ignore_eos": True, "detokenize": False}
    outs = engine.generate([(i, p.tolist(), params) for i, p in enumerate(prompts)])
    return [list(o.output_token_ids) for o in outs]


def score(engine, sequences: list[list[int]], out: int) -> np.ndarray:
    """Raw logprobs ``[num_sequences, out]`` of each sequence's last ``out`` tokens."""
    params = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}
    outs = engine.generate([(i, s, params) for i, s in enumerate(sequences)])
    return np.array([o.prompt_logprobs[-out:] for o in outs], dtype=np.float64)


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Identical greedy outputs and the mean fraction of each output before the first
    difference."""
    prefix = []
    for a, b in zip(ours, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        prefix.append(same / max(len(b), 1))
    return {"identical": int(sum(a == b for a, b in zip(ours, reference))),
            "num_prompts": len(reference), "mean_shared_prefix": float(np.mean(prefix))}


def drift(a: np.ndarray, b: np.ndarray) -> dict:
    diff = np.abs(a - b)
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
            "p99_abs": float(np.quantile(diff, 0.99))}


def host_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return {k: v.to(torch.bfloat16) for k, v in weights.items()}


def update_seconds(engine, weights: dict[str, torch.Tensor]) -> dict:
    engine.update_weights(weights)  # first call: allocator, kernels
    sync()
    t0 = time.perf_counter()
    stats = engine.update_weights(weights)
    return {"seconds": time.perf_counter() - t0, "num_tensors": stats["num_tensors"],
            "num_bytes": stats["num_bytes"]}


def run_engine(path: Path, n: int, model_len: int, dtype: str, quantization: str | None,
               prompts: np.ndarray, quality: np.ndarray, out: int, quality_out: int,
               reference: list[list[int]] | None, weights, args,
               kv_cache_dtype: str = "auto") -> dict:
    """One engine: throughput (bf16 / FP8 only), greedy outputs and scores of the reference
    sequences (the bf16 engine's greedy outputs, its own when ``reference`` is None)."""
    from actors.engine.llm_engine import Engine

    t0 = time.perf_counter()
    engine = Engine(str(path), engine_options(n, model_len, dtype, quantization, args,
                                              kv_cache_dtype))
    info = engine.info()
    result = {"load_s": time.perf_counter() - t0, "quantization": info["quantization"],
              "cuda_graphs": info["cuda_graphs"], "attention_backend": info["attention_backend"],
              "kv_cache_dtype": info["kv_cache_dtype"], "num_kv_blocks": info["num_kv_blocks"]}
    label = f"{dtype} {quantization} kv {info['kv_cache_dtype']}"
    if dtype != "float32":
        result["throughput"] = throughput(engine, prompts, out)
        log(f"{label}: {result['throughput']['output_tok_s']:.0f} output tok/s")
    result["greedy"] = greedy(engine, quality, quality_out)
    sequences = [p.tolist() + g for p, g in zip(quality, reference or result["greedy"])]
    result["scores"] = score(engine, sequences, quality_out)
    if weights is not None:
        result["update_weights"] = update_seconds(engine, weights)
        log(f"{label}: update_weights {result['update_weights']['seconds']:.2f} s")
    del engine
    free()
    return result


def bench(name: str, args) -> dict:
    spec, n, prompt, out = WORKLOADS[name]
    n = args.num_prompts or n
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, spec["vocab_size"] - 1, size=(n, prompt), dtype=np.int64)
    quality = prompts[:args.quality_prompts]
    quality_out = min(out, args.quality_tokens)
    model_len = prompt + out + 1
    bf16 = "bfloat16"
    kernels = []
    if DEVICE == "cuda":
        kernels = [layer_kernels(spec, rows)
                   for rows in (n, min(args.max_batched_tokens, n * prompt))]
        free()
        log(f"{name}: one layer's pieces {json.dumps(kernels)}")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        log(f"{name}: building the model")
        model = build_model({**spec}, Path(tmp))
        del model
        free()
        weights = None if args.skip_update else host_weights(Path(tmp))
        common = {"path": Path(tmp), "n": n, "model_len": model_len, "prompts": prompts,
                  "quality": quality, "out": out, "quality_out": quality_out, "args": args}
        log(f"{name}: bf16 engine")
        base = run_engine(dtype=bf16, quantization=None, reference=None, weights=weights,
                          **common)
        reference = base["greedy"]
        log(f"{name}: fp8 engine")
        fp8 = run_engine(dtype=bf16, quantization="fp8", reference=reference, weights=weights,
                         **common)
        fp8_kv = None
        if args.kv_fp8:
            log(f"{name}: fp8 engine with an fp8 KV cache")
            fp8_kv = run_engine(dtype=bf16, quantization="fp8", reference=reference,
                                weights=None, kv_cache_dtype="fp8", **common)
        fp32 = None
        if not args.no_fp32:
            log(f"{name}: fp32 reference engine")
            fp32 = run_engine(dtype="float32", quantization=None, reference=reference,
                              weights=None, **{**common, "n": len(quality)})
    result = {"workload": name, "num_prompts": n, "prompt_len": prompt, "output_len": out,
              "layer_kernels": kernels,
              "quality_prompts": len(quality), "quality_tokens": quality_out,
              "bf16": {k: v for k, v in base.items() if k not in ("greedy", "scores")},
              "fp8": {k: v for k, v in fp8.items() if k not in ("greedy", "scores")},
              "speedup": (fp8["throughput"]["output_tok_s"]
                          / base["throughput"]["output_tok_s"]),
              "greedy_fp8_vs_bf16": agreement(fp8["greedy"], reference),
              "logprob_fp8_vs_bf16": drift(fp8["scores"], base["scores"])}
    if fp8_kv is not None:
        result["fp8_kv"] = {k: v for k, v in fp8_kv.items() if k not in ("greedy", "scores")}
        result["speedup_fp8_kv"] = (fp8_kv["throughput"]["output_tok_s"]
                                    / base["throughput"]["output_tok_s"])
        result["greedy_fp8_kv_vs_bf16"] = agreement(fp8_kv["greedy"], reference)
        result["logprob_fp8_kv_vs_bf16"] = drift(fp8_kv["scores"], base["scores"])
    if fp32 is not None:
        result["greedy_fp32_vs_bf16"] = agreement(fp32["greedy"], reference)
        result["logprob_bf16_vs_fp32"] = drift(base["scores"], fp32["scores"])
        result["logprob_fp8_vs_fp32"] = drift(fp8["scores"], fp32["scores"])
        result["fp32_load_s"] = fp32["load_s"]
    log(f"{name}: {json.dumps(result)}")
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="llama3-8b-256,qwen2-0.5b-128")
    p.add_argument("--out", default=".", help="directory for fp8_bench.json")
    p.add_argument("--num-prompts", type=int, default=0, help="override the prompt count")
    p.add_argument("--quality-prompts", type=int, default=64)
    p.add_argument("--quality-tokens", type=int, default=64,
                   help="greedy output tokens per quality prompt (at most the output length)")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference engine")
    p.add_argument("--skip-update", action="store_true", help="skip the update_weights timing")
    p.add_argument("--kv-fp8", action="store_true",
                   help="also run FP8 weights with an FP8 KV cache (kv_cache_dtype: fp8)")
    p.add_argument("--max-batched-tokens", type=int, default=32768)
    p.add_argument("--memory", type=float, default=0.85, help="gpu_memory_utilization")
    p.add_argument("--tmp", default=None, help="where models are saved (a temp dir inside)")
    args = p.parse_args(argv)
    if args.quality_prompts < 1 or args.quality_tokens < 1:
        p.error("--quality-prompts and --quality-tokens must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            p.error(f"--workloads: unknown {name!r} (known: {', '.join(WORKLOADS)})")
        results.append(bench(name, args))
        (out / "fp8_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
             "torch": torch.__version__, "results": results}, indent=1))
    print(f"\n{'workload':16} {'engine':7} {'tok/s':>8} {'ratio':>6} {'decode ms':>9} "
          f"{'greedy same':>11} {'|x-bf16| mean/max':>20} {'|bf16-fp32| mean/max':>21}")
    for r in results:
        ref = r.get("logprob_bf16_vs_fp32")
        rows = [("bf16", r["bf16"], 1.0, None, None),
                ("fp8", r["fp8"], r["speedup"], r["greedy_fp8_vs_bf16"],
                 r["logprob_fp8_vs_bf16"])]
        if "fp8_kv" in r:
            rows.append(("fp8+kv", r["fp8_kv"], r["speedup_fp8_kv"],
                         r["greedy_fp8_kv_vs_bf16"], r["logprob_fp8_kv_vs_bf16"]))
        for side, values, ratio, g, d in rows:
            t = values["throughput"]
            decode = t.get("ms_per_decode_step")
            print(f"{r['workload']:16} {side:7} {t['output_tok_s']:8.0f} {ratio:6.2f} "
                  + (f"{decode:9.2f} " if decode is not None else f"{'-':>9} ")
                  + (f"{g['identical']:>5}/{g['num_prompts']:<5} "
                     f"{d['mean_abs']:9.4f}/{d['max_abs']:<9.4f} " if g else f"{'':33} ")
                  + (f"{ref['mean_abs']:10.4f}/{ref['max_abs']:<9.4f}"
                     if ref and side == "bf16" else ""))
    return results


if __name__ == "__main__":
    main()
