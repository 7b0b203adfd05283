"""End-to-end throughput: HF ``generate`` and the raygen engine on the same prompts, one run.

vLLM throughput-benchmark style: every request is submitted at once, prompts are random token
ids of a fixed length, outputs have a fixed length (EOS ignored), sampling with temperature and
top-p. Models are built on the GPU from configs with random bf16 weights, saved with
``save_pretrained`` (plus a small trained tokenizer: prompts are token ids, nothing is
detokenized), and loaded back by the engine.

    python benchmarks/e2e_bench.py --out /tmp/e2e            # all workloads
    python benchmarks/e2e_bench.py --workloads qwen2-0.5b-128 --hf-batches 512,1024
    python benchmarks/e2e_bench.py --workloads qwen2-0.5b-128 --skip-hf --repeat-runs 2

Per workload it reports output and total tok/s of both, their ratio, ms per decode step (median
start-to-start period of pure-decode steps, CUDA events), the GPU idle fraction between those
steps, the sampler's share of a step, and the fraction of the compute and memory floors
(measured bf16 matmul rate and copy bandwidth). JSON lands in ``--out``; a PNG plot too when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
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

from engine_floors import floors, matmul_floor, measure_ceilings  # noqa: E402

QWEN2_05B = dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)
LLAMA3_8B = dict(arch="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 tie_word_embeddings=False, rope_theta=5e5, max_position_embeddings=8192)
TINY = dict(arch="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, vocab_size=512,
            tie_word_embeddings=True, max_position_embeddings=1024)
WORKLOADS = {  # name: (model config, prompts, prompt length, output length)
    "tiny": (TINY, 8, 16, 8),  # a smoke test of the script (CPU or GPU)
    "qwen2-0.5b-128": (QWEN2_05B, 1024, 128, 128),
    "qwen2-0.5b-512": (QWEN2_05B, 1024, 512, 512),
    "llama3-8b-256": (LLAMA3_8B, 512, 256, 256),
}
TEMPERATURE, TOP_P = 0.8, 0.95
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(spec: dict, path: Path) -> torch.nn.Module:
    """Random bf16 weights on the GPU, saved with a trained tokenizer; returns the model."""
    import transformers

    from toolkit.tiny_model import train_tokenizer

    spec = dict(spec)
    arch = spec.pop("arch")
    cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    cfg = cls(**spec, bos_token_id=0, eos_token_id=2, pad_token_id=3)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    model.save_pretrained(path, max_shard_size="50GB")
    train_tokenizer(512).save_pretrained(path)
    return model


def run_hf(model, prompts: np.ndarray, out: int, batch: int) -> float:
    """Seconds for HF generate over all prompts in batches of ``batch``."""
    def gen(rows, new_tokens=out):
        ids = torch.from_numpy(np.ascontiguousarray(rows)).to(DEVICE)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                       temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    with torch.no_grad():
        gen(prompts[:2, :16], 4)  # warm-up
        with frozen_heap():
            sync()
            t0 = time.perf_counter()
            for i in range(0, len(prompts), batch):
                gen(prompts[i:i + batch])
            sync()
    return time.perf_counter() - t0


@contextlib.contextmanager
def frozen_heap():
    """Collects, then freezes what is alive (modules, model, engine) for the timed run, as a
    job's actors do after startup (actors/actor.py): a full collection of the process (0.16 s
    for the ~210k objects of torch and transformers alone on a development machine, more with
    a model and HF's generate state) cannot land inside the timed steps."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def timed_run(engine, prompts: np.ndarray, params: list, tag: str, steps: bool = True):
    """Seconds of one timed run of every prompt through ``engine`` (request ids ``tag`` +
    the row; the row alone without a tag), with its StepTimer on CUDA when ``steps`` (else
    None)."""
    from actors.engine.step_timer import StepTimer

    timer = StepTimer().attach(engine) if steps and DEVICE == "cuda" else None
    with frozen_heap():
        sync()
        t0 = time.perf_counter()
        for i, p in enumerate(params):
            engine.add_request(f"{tag}{i}" if tag else i, prompts[i].tolist(), p)
        done = 0
        while engine.has_unfinished_requests():
            done += len(engine.step())
        elapsed = time.perf_counter() - t0
    assert done == len(params)
    return elapsed, timer


def run_engine(path: Path, prompts: np.ndarray, out: int, args) -> dict:
    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    n, prompt_len = prompts.shape
    t0 = time.perf_counter()
    engine = Engine(str(path), {
        "max_num_seqs": n, "max_num_batched_tokens": args.max_batched_tokens,
        "max_model_len": prompt_len + out,
        "cuda_graphs": DEVICE == "cuda" and not args.no_graphs,
        "fused_layers": False if args.no_fused_layers else None,
        "fused_projections": False if args.no_fused_projections else None,
        "enable_prefix_caching": False, "gpu_memory_utilization": 0.9})
    load_s = time.perf_counter() - t0
    if args.mix == "job":  # job_bench's per-row mix (greedy, top-p, top-k, min-p, logprobs)
        from benchmarks.job_rows import row_params
        params = [SamplingParams(max_tokens=out, ignore_eos=True, detokenize=False,
                                 **row_params(i)) for i in range(n)]
    else:
        params = [SamplingParams(max_tokens=out, ignore_eos=True, temperature=TEMPERATURE,
                                 top_p=TOP_P, seed=i, detokenize=False) for i in range(n)]
    # warm-up: prefill, graph replays, the sampler's kernels (for a per-row mix, a whole
    # batch of it: each combination of params the steps will see compiles its kernels)
    warm = [p.replace(max_tokens=8) for p in (params if args.mix == "job" else params[:4])]
    engine.generate([(f"w{i}", prompts[i, :16].tolist(), w) for i, w in enumerate(warm)])
    elapsed, timer = timed_run(engine, prompts, params, "")
    timing = {}
    if timer is not None:
        timing = {**timer.summary(), "num_steps": len(timer.steps),
                  **{f"at_256_{k}": v for k, v in timer.summary(min_batch=256).items()
                     if k != "largest_gaps"}}
        timer.detach()
    repeats = []  # the same run again on the warm engine: what the first paid only once
    for r in range(args.repeat_runs):
        again, timer = timed_run(engine, prompts, params, f"r{r}-")
        run = {"elapsed_s": again, "output_tok_s": n * out / again}
        if timer is not None:
            summary = timer.summary()
            timer.detach()
            run.update({k: summary.get(k) for k in ("ms_per_decode_step", "host_launch_ms")})
            run["largest_gaps"] = summary.get("largest_gaps", [])[:3]
        repeats.append(run)
    info = engine.info()
    extra = {}
    for top_p in args.extra_top_p:  # the same engine, other sampling settings
        more = [p.replace(top_p=top_p) for p in params]
        again, _ = timed_run(engine, prompts, more, f"x{top_p}-", steps=False)
        extra[str(top_p)] = n * out / again
    stats = {"elapsed_s": elapsed, "load_and_capture_s": load_s, **timing,
             "repeat_runs": repeats,
             "attention_backend": info["attention_backend"],
             "cuda_graphs": info["cuda_graphs"], "fused_layers": info["fused_layers"],
             "fused_projections": info["fused_projections"],
             "sampler_backend": engine.sampler.backend,
             "num_kv_blocks": info["num_kv_blocks"], "output_tok_s_at_top_p": extra}
    del engine
    return stats


def bench(name: str, args, ceil: dict) -> dict:
    spec, n, prompt, out = WORKLOADS[name]
    n = args.num_prompts or n
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, spec["vocab_size"] - 1, size=(n, prompt), dtype=np.int64)
    result = {"workload": name, "mix": args.mix, "num_prompts": n, "prompt_len": prompt,
              "output_len": out,
              **floors(spec, n, prompt, out, ceil)}
    if DEVICE == "cuda":
        result.update(matmul_floor(spec, n, prompt, out, args.max_batched_tokens))
        result["serial_floor_s"] = result["matmul_s"] + result["kv_read_s"]
        log(f"{name}: matmuls {json.dumps(result['matmuls'])}, KV reads {result['kv_read_s']:.3f} s")
        torch.cuda.empty_cache()
    if args.floors_only:
        return result
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        log(f"{name}: building the model")
        model = build_model(spec, Path(tmp))
        hf = {}
        for batch in ([] if args.skip_hf else args.hf_batches or [n]):
            log(f"{name}: HF generate, batch {batch}")
            hf[batch] = run_hf(model, prompts, out, min(batch, n))
        del model
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        log(f"{name}: engine")
        ours = run_engine(Path(tmp), prompts, out, args)
    tokens_out, tokens_all = n * out, n * (prompt + out)
    result["engine"] = {**ours, "output_tok_s": tokens_out / ours["elapsed_s"],
                        "total_tok_s": tokens_all / ours["elapsed_s"]}
    result["engine"]["compute_floor_fraction"] = result["compute_s"] / ours["elapsed_s"]
    if ours.get("decode_steps"):
        step_floor = result["decode_memory_s"] / (out - 1) * 1e3
        result["engine"]["decode_memory_floor_fraction"] = step_floor / ours["ms_per_decode_step"]
    if hf:
        best = min(hf, key=hf.get)
        result["hf"] = {"batches": {str(b): tokens_out / s for b, s in hf.items()},
                        "best_batch": best, "elapsed_s": hf[best],
                        "output_tok_s": tokens_out / hf[best], "total_tok_s": tokens_all / hf[best]}
        result["speedup"] = hf[best] / ours["elapsed_s"]
    log(f"{name}: {json.dumps(result)}")
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if "engine" in r]
    if not results:
        return

    names = [r["workload"] for r in results]
    ours = [r["engine"]["output_tok_s"] for r in results]
    hf = [r.get("hf", {}).get("output_tok_s", 0.0) for r in results]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(x - 0.2, hf, 0.4, label="HF generate (best batch)")
    ax.bar(x + 0.2, ours, 0.4, label="raygen engine")
    for i, r in enumerate(results):
        if "speedup" in r:
            ax.text(x[i] + 0.2, ours[i], f"{r['speedup']:.1f}x", ha="center", va="bottom")
    ax.set_xticks(x, names)
    ax.set_ylabel("output tokens / s")
    ax.set_title("End-to-end throughput on one H200 (random bf16 weights)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w != "tiny"))
    p.add_argument("--out", default=".", help="directory for e2e_bench.json (and the plot)")
    p.add_argument("--hf-batches", default="", help="HF batch sizes (default: all prompts)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--floors-only", action="store_true",
                   help="measure the ceilings and each workload's floors only (no models)")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-fused-layers", action="store_true",
                   help="the model's own RMSNorm / rotary / SiLU code (no actors.engine.model.kernels)")
    p.add_argument("--no-fused-projections", action="store_true",
                   help="q/k/v and gate/up as the model's separate GEMMs")
    p.add_argument("--num-prompts", type=int, default=0, help="override the prompt count")
    p.add_argument("--mix", choices=("top_p", "job"), default="top_p",
                   help="the engine's sampling params: T + top-p (default), or job_bench's "
                   "per-row mix (HF still samples with T + top-p)")
    p.add_argument("--max-batched-tokens", type=int, default=32768)
    p.add_argument("--repeat-runs", type=int, default=0,
                   help="time the engine's run this many more times on the same engine "
                        "(engine.repeat_runs; the headline stays the first run)")
    p.add_argument("--extra-top-p", default="", help="top-p values for extra engine runs "
                   "(output tok/s only), e.g. 1.0 for temperature-only sampling")
    p.add_argument("--tmp", default=None, help="where models are saved (a temp dir inside)")
    args = p.parse_args(argv)
    args.hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    args.extra_top_p = [float(v) for v in args.extra_top_p.split(",") if v]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = measure_ceilings(DEVICE)
    log(f"ceilings: {ceil}")
    results = []
    for name in args.workloads.split(","):
        results.append(bench(name, args, ceil))
        (out / "e2e_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
             "ceilings": ceil, "results": results},
            indent=1))
    print(f"\n{'workload':16} {'HF out tok/s':>12} {'ours out tok/s':>14} {'ratio':>6} "
          f"{'ms/step':>8} {'idle':>6} {'sampler ms':>10}")
    for r in results:
        if "engine" not in r:
            continue
        e = r["engine"]
        print(f"{r['workload']:16} {r.get('hf', {}).get('output_tok_s', 0):12.0f} "
              f"{e['output_tok_s']:14.0f} {r.get('speedup', 0):6.2f} "
              f"{e.get('ms_per_decode_step', 0):8.2f} {e.get('idle_fraction', 0):6.3f} "
              f"{e.get('sampler_ms_per_step', 0):10.2f}")
    try:
        plot(results, out / "e2e_bench.png")
    except ImportError:
        log("matplotlib missing: no plot")
    return results


if __name__ == "__main__":
    main()
