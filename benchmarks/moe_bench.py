"""MoE throughput: the engine with the fused MoE path against the engine with transformers'
MoE modules, on the same model in one run.

Models are built on the GPU from configs with random bf16 weights (nothing is saved but the
config and a small tokenizer); both engines load that one model object. Per model and batch:
N prompts of random token ids x P prompt tokens, O output tokens (EOS ignored), temperature
0.8 + top-p 0.95. Reported per path: output tok/s, ms per decode step (StepTimer, median
start-to-start period of pure-decode steps), prefill GPU time; and the floors: the expert-read
floor of a decode step (bytes of the experts the batch touches, uniform routing expected,
over the copy bandwidth) and the prefill matmul floor (FLOPs of all prefill tokens over the
bf16 matmul rate).

    python benchmarks/moe_bench.py --out /tmp/moe                 # qwen3-30b-a3b, mixtral
    python benchmarks/moe_bench.py --models qwen3-30b-a3b --batches 512 --kernel-sweep
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_kernel_sweep import COPY_TBPS, kernel_sweep, moe_shape  # noqa: E402

MATMUL_TFLOPS = 764.0  # H200: bf16 matmul rate
TEMPERATURE, TOP_P = 0.8, 0.95
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

QWEN3_30B_A3B = dict(arch="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     intermediate_size=6144, norm_topk_prob=True, vocab_size=151936,
                     tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=4096)
MIXTRAL_8X7B_16L = dict(arch="mixtral", hidden_size=4096, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                        vocab_size=32000, tie_word_embeddings=False, rope_theta=1e6,
                        max_position_embeddings=4096)
TINY_QWEN3_MOE = dict(arch="qwen3_moe", hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=96, norm_topk_prob=True, vocab_size=512,
                      tie_word_embeddings=False, max_position_embeddings=256)
TINY_MIXTRAL = dict(arch="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=48, vocab_size=512,
                    tie_word_embeddings=False, max_position_embeddings=256)
MODELS = {  # name: (config, default batches)
    "qwen3-30b-a3b": (QWEN3_30B_A3B, [512, 1024]),
    "mixtral-8x7b-16l": (MIXTRAL_8X7B_16L, [512]),
    "tiny-qwen3-moe": (TINY_QWEN3_MOE, [6]),  # smoke tests of the script (CPU or GPU)
    "tiny-mixtral": (TINY_MIXTRAL, [6]),
}
PATHS = ("hf", "fused")  # the HF-module path first: the fused one patches the model


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def expected_experts_touched(spec: dict, rows: int) -> float:
    """Experts a layer reads for ``rows`` tokens under uniform routing."""
    experts, top_k, _ = moe_shape(spec)
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def floors(spec: dict, rows: int, prompt: int, out: int = 128, copy_tbps: float = COPY_TBPS,
           matmul_tflops: float = MATMUL_TFLOPS) -> dict:
    """The expert-read floor of one decode step of ``rows`` sequences (ms), the other reads
    of a step (attention and router weights with the LM head; the KV cache at the mean
    context ``prompt + out / 2``), and the matmul floor of prefilling ``rows`` prompts of
    ``prompt`` tokens (s)."""
    h, layers = spec["hidden_size"], spec["num_hidden_layers"]
    heads, kv, d = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    experts, top_k, width = moe_shape(spec)
    expert_bytes = 3 * h * width * 2
    touched = expected_experts_touched(spec, rows)
    read = layers * touched * expert_bytes
    dense = layers * (2 * h * heads * d + 2 * h * kv * d + h * experts) * 2  # attn + router
    tokens = rows * prompt
    flop_token = 2 * layers * (2 * h * heads * d + 2 * h * kv * d + h * experts
                               + top_k * 3 * h * width)
    attention = 4 * layers * heads * d * rows * prompt * (prompt + 1) / 2
    lm_head = 2 * h * spec["vocab_size"] * rows  # the last prompt token of each row
    prefill_flops = flop_token * tokens + attention + lm_head
    return {"experts_touched_per_layer": touched,
            "expert_read_bytes_per_step": read,
            "expert_read_floor_ms": read / (copy_tbps * 1e12) * 1e3,
            "dense_read_floor_ms": (dense + 2 * h * spec["vocab_size"]) / (copy_tbps * 1e12)
            * 1e3,
            "kv_read_floor_ms": layers * 2 * kv * d * 2 * rows * (prompt + out / 2)
            / (copy_tbps * 1e12) * 1e3,
            "prefill_flops": prefill_flops,
            "prefill_matmul_floor_s": prefill_flops / (matmul_tflops * 1e12)}


def build_model(spec: dict):
    """The model on the device with random weights (bf16 on CUDA, fp32 on CPU)."""
    import transformers

    spec = dict(spec)
    arch = spec.pop("arch")
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[arch]
    cfg = cls(**spec, bos_token_id=0, eos_token_id=2, pad_token_id=3)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


@contextmanager
def serving(model, path: Path):
    """``from_pretrained`` of ``path`` hands out ``model`` (with the attention implementation
    the engine asks for): the engine loads it without weights on disk."""
    import transformers

    def load(*args, **kwargs):
        model.set_attn_implementation(kwargs["attn_implementation"])
        return model

    model.config.save_pretrained(path)
    with mock.patch.object(transformers.AutoModelForCausalLM, "from_pretrained",
                           side_effect=load):
        yield


def _restore_moe_forwards(model) -> None:
    """Drops the fused MoE forwards an earlier engine installed (instance attributes)."""
    for module in model.modules():
        if hasattr(module, "_fused_moe_plan"):
            module.__dict__.pop("forward", None)
            del module._fused_moe_plan


def prefill_gpu_s(timer) -> float:
    """GPU seconds of the steps that were not pure decodes."""
    torch.cuda.synchronize()
    return sum(s.events["gpu_start"].elapsed_time(s.events["end"]) / 1e3 for s in timer.steps
               if s.num_tokens != s.num_seqs and "gpu_start" in s.events and "end" in s.events)


def run_batch(engine, prompts: np.ndarray, out: int) -> dict:
    from actors.engine.step_timer import StepTimer
    from sampler import SamplingParams

    n = len(prompts)
    params = [SamplingParams(max_tokens=out, ignore_eos=True, temperature=TEMPERATURE,
                             top_p=TOP_P, seed=i, detokenize=False) for i in range(n)]
    timer = StepTimer().attach(engine) if DEVICE == "cuda" else None
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate([(i, prompts[i].tolist(), params[i]) for i in range(n)])
    elapsed = time.perf_counter() - t0
    assert len(outs) == n and all(o.num_output_tokens == out for o in outs)
    stats = {"elapsed_s": elapsed, "output_tok_s": n * out / elapsed}
    if timer is not None:
        summary = timer.summary()
        stats.update({k: summary[k] for k in ("decode_steps", "ms_per_decode_step",
                                              "gpu_ms_per_step", "idle_fraction")
                      if k in summary})
        stats["prefill_gpu_s"] = prefill_gpu_s(timer)
        timer.detach()
    return stats


def profile_decode(engine, n: int, prompt: int, max_tokens: int, steps: int, vocab: int,
                   rng) -> list[dict]:
    """The device time of each kernel of ``steps`` pure-decode steps of ``n`` rows
    (``torch.profiler``), microseconds a step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_requests([(f"p{i}", rng.integers(100, vocab - 1, prompt).tolist(),
                          {"max_tokens": steps + 16, "ignore_eos": True}) for i in range(n)])
    for _ in range(-(-n * prompt // max_tokens) + 4):  # prefill, then a few decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    rows = [{"kernel": e.key[:120], "us_per_step": e.self_device_time_total / steps,
             "calls_per_step": e.count / steps}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def run_path(model, path: Path, which: str, batches: list[int], prompt: int, out: int,
             args) -> dict:
    from actors.engine.llm_engine import Engine

    _restore_moe_forwards(model)
    t0 = time.perf_counter()
    with serving(model, path):
        engine = Engine(str(path), {
            "max_num_seqs": max(batches), "max_num_batched_tokens": args.max_batched_tokens,
            "max_model_len": prompt + out, "enable_prefix_caching": False,
            "fused_moe": which == "fused", "gpu_memory_utilization": 0.9})
    result = {"startup_s": time.perf_counter() - t0, "fused_moe": engine.info()["fused_moe"],
              "experts_implementation": getattr(model.config, "_experts_implementation", None),
              "cuda_graphs": engine.info()["cuda_graphs"], "batches": {}}
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    # warm-up: the largest batch's prefill steps (first calls at a size, e.g. grouped_mm's,
    # cost seconds once: run CL's HF path paid ~10 s in its first measured batch after a
    # one-step warm-up) and a few decode steps
    engine.generate([(f"w{i}", rng.integers(100, vocab - 1, prompt).tolist(),
                      {"max_tokens": 4, "ignore_eos": True}) for i in range(max(batches))])
    for n in batches:
        prompts = rng.integers(100, vocab - 1, size=(n, prompt), dtype=np.int64)
        log(f"  {which}: {n} prompts x {prompt}/{out}")
        result["batches"][str(n)] = run_batch(engine, prompts, out)
        log(f"  {which}: {json.dumps(result['batches'][str(n)])}")
    if args.profile_steps and DEVICE == "cuda":
        try:
            result["profile"] = profile_decode(engine, max(batches), prompt,
                                               args.max_batched_tokens, args.profile_steps,
                                               vocab, rng)
            log(f"  {which}: decode step kernels {json.dumps(result['profile'][:12])}")
        except Exception as exc:  # noqa: BLE001 - a benchmark records what failed
            result["profile"] = {"error": repr(exc)}
    engine.sleep(1)  # the KV pages and captured graphs go now, before the next engine
    del engine
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def bench(name: str, args) -> dict:
    from toolkit.tiny_model import train_tokenizer

    spec, default_batches = MODELS[name]
    batches = args.batches or default_batches
    prompt, out = args.prompt_len, args.output_len
    result = {"model": name, "config": spec, "prompt_len": prompt, "output_len": out,
              "floors": {str(n): floors(spec, n, prompt, out) for n in batches}}
    if args.kernel_sweep and DEVICE == "cuda":
        log(f"{name}: one layer's experts alone")
        result["kernels"] = kernel_sweep(spec, [*batches, args.max_batched_tokens], log)
    if not args.paths:
        return result
    log(f"{name}: building the model")
    t0 = time.perf_counter()
    model = build_model(spec)
    result["build_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        train_tokenizer(512).save_pretrained(tmp)
        for which in args.paths:
            log(f"{name}: engine with the {which} MoE path")
            result[which] = run_path(model, Path(tmp), which, batches, prompt, out, args)
    del model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    result["summary"] = summarize(result, batches)
    log(f"{name}: {json.dumps(result['summary'])}")
    return result


def summarize(result: dict, batches: list[int]) -> dict:
    """Per batch: the fused path's decode step over the expert-read floor and its output
    tok/s over the HF path's."""
    out = {}
    for n in batches:
        key = str(n)
        row = {}
        fused = result.get("fused", {}).get("batches", {}).get(key, {})
        hf = result.get("hf", {}).get("batches", {}).get(key, {})
        floor_ms = result["floors"][key]["expert_read_floor_ms"]
        for which, stats in (("fused", fused), ("hf", hf)):
            if "ms_per_decode_step" in stats:
                row[f"{which}_ms_per_decode_step"] = stats["ms_per_decode_step"]
                row[f"{which}_step_over_floor"] = stats["ms_per_decode_step"] / floor_ms
            if "output_tok_s" in stats:
                row[f"{which}_output_tok_s"] = stats["output_tok_s"]
        row["expert_read_floor_ms"] = floor_ms
        if fused and hf:
            row["tok_s_speedup"] = fused["output_tok_s"] / hf["output_tok_s"]
        out[key] = row
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b-16l")
    p.add_argument("--batches", default="", help="prompt counts (default: per model)")
    p.add_argument("--paths", default=",".join(PATHS), help="hf,fused or one of them")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--kernel-sweep", action="store_true",
                   help="also time one layer's experts alone (CUDA): the tile table, other "
                   "tiles, transformers' grouped_mm")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also list the kernels of this many decode steps of each path")
    p.add_argument("--out", default=".", help="directory for moe_bench.json")
    p.add_argument("--tmp", default=None, help="where the config and tokenizer are written")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.paths = [w for w in PATHS if w in args.paths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.models.split(","):
        results.append(bench(name, args))
        (out / "moe_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
             "torch": torch.__version__, "copy_tbps": COPY_TBPS,
             "matmul_tflops": MATMUL_TFLOPS, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
