"""RL figures: weight-update time, memory freed by sleep(), raw-logprob parity with HF.

    python benchmarks/rl_bench.py --out docs/records                       # GPU, every mode
    python benchmarks/rl_bench.py --modes update --workloads llama3-8b     # one mode / model
    python benchmarks/rl_bench.py --workloads tiny --transport local --out /tmp/rl  # CPU smoke

Modes:

- ``update``: a trainer-side state dict (host memory, the model's dtype, every name including
  tied ones) pushed into a 1-actor ``RolloutPool`` through Ray's object store, end to end
  (``pool.update_weights(state_dict)``: pack, put, get, copy to the device), then the actor
  side alone (``pool.update_weights(ref)`` with the payload already in the store), and the
  device-to-device floor (``Engine.update_weights`` from tensors already on the GPU, in
  process). ``--transport local`` replaces the pool with an in-process engine fed the same
  packed payload (no Ray).
- ``sleep``: an in-process engine with the default KV budget; device memory free before and
  after ``sleep(1)`` (``torch.cuda.mem_get_info``) over the KV pool size (target >= 0.9), the
  same for ``sleep(2)`` and the weights, wake-up time (graph re-capture included), and the
  greedy outputs after wake-up + reload against those before sleep.
- ``parity``: seeded sampled outputs with ``raw_logprobs``; the same tokens scored by the HF
  forward in the engine's dtype and in float32; mean and max |difference| of the engine vs
  HF (same dtype), engine vs float32, and HF (same dtype) vs float32 (the dtype's own error).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_bench import LLAMA3_8B, QWEN2_05B, TINY, build_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = {"qwen2-0.5b": QWEN2_05B, "llama3-8b": LLAMA3_8B, "tiny": TINY}
MODES = ("update", "sleep", "parity")
# requests and output tokens of the sleep and parity runs (the tiny one is a smoke test)
SIZES = {"tiny": {"requests": 4, "tokens": 8}}
DEFAULT_SIZE = {"requests": 32, "tokens": 64}
SMALL_KV = {"num_kv_blocks": 512, "max_model_len": 2048}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def engine_options(dtype: str, **extra) -> dict:
    return {"dtype": dtype, "max_num_seqs": 64, "enable_prefix_caching": True, **extra}


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------- update
def bench_update(path: str, model, args) -> dict:
    from actors.engine.weights import pack_weights

    host = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    device_state = dict(model.state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in host.values())
    out = {"num_tensors": len(host), "gib": nbytes / 2**30}
    if args.transport == "ray":
        from toolkit import RolloutPool
        import ray

        gpus = 1 if DEVICE == "cuda" else 0
        with RolloutPool(path, 1, engine=engine_options(args.dtype, **SMALL_KV),
                         num_gpus_per_actor=gpus) as pool:
            pool.update_weights(host)  # warm-up
            e2e = timed(lambda: pool.update_weights(host), args.reps)
            t0 = time.perf_counter()
            ref = ray.put(pack_weights(host.items()))
            put_s = time.perf_counter() - t0
            actor = timed(lambda: pool.update_weights(ref), args.reps)
            del ref
        out.update(end_to_end_s=statistics.median(e2e), object_store_put_s=put_s,
                   actor_side_s=statistics.median(actor))
    else:
        from actors.engine.llm_engine import Engine

        engine = Engine(path, engine_options(args.dtype, **SMALL_KV))
        e2e = timed(lambda: engine.update_weights(pack_weights(host.items())), args.reps)
        out.update(end_to_end_s=statistics.median(e2e))
        del engine
        gc.collect()
    from actors.engine.llm_engine import Engine

    engine = Engine(path, engine_options(args.dtype, **SMALL_KV))  # device-to-device floor
    floor = timed(lambda: engine.update_weights(device_state), args.reps)
    out["device_to_device_s"] = statistics.median(floor)
    out["end_to_end_gib_s"] = out["gib"] / out["end_to_end_s"]
    del engine, host, device_state
    gc.collect()
    return out


# ---------------------------------------------------------------------- sleep
def free_bytes() -> int | None:
    if DEVICE != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def bench_sleep(path: str, size: dict, args) -> dict:
    from actors.engine.llm_engine import Engine

    options = engine_options(args.dtype, max_model_len=2048)
    if DEVICE != "cuda":
        options.update(SMALL_KV)
    engine = Engine(path, options)
    rng = np.random.default_rng(1)
    vocab = engine.loaded.vocab_size
    requests = [(i, rng.integers(10, vocab, 64).tolist(),
                 {"temperature": 0.0, "max_tokens": size["tokens"], "ignore_eos": True,
                  "detokenize": False})
                for i in range(size["requests"])]
    before = [o.output_token_ids for o in engine.generate(requests)]
    state = {k: v.detach().to("cpu", copy=True) for k, v in engine.loaded.model.state_dict().items()}
    kv_bytes = engine.kv_cache.nbytes
    free0 = free_bytes()
    t0 = time.perf_counter()
    freed1 = engine.sleep(1)
    sleep1_s = time.perf_counter() - t0
    free1 = free_bytes()
    t0 = time.perf_counter()
    engine.wake_up()
    wake1_s = time.perf_counter() - t0
    same1 = [o.output_token_ids for o in engine.generate(requests)] == before
    free2a = free_bytes()
    freed2 = engine.sleep(2)
    free2 = free_bytes()
    t0 = time.perf_counter()
    engine.wake_up(["weights"])
    engine.update_weights(state)
    engine.wake_up(["kv_cache"])
    wake2_s = time.perf_counter() - t0
    same2 = [o.output_token_ids for o in engine.generate(requests)] == before
    out = {"kv_cache_gib": kv_bytes / 2**30, "engine_reported_freed": freed1,
           "sleep1_s": sleep1_s, "wake1_s": wake1_s, "wake2_and_reload_s": wake2_s,
           "outputs_equal_after_level1": same1, "outputs_equal_after_level2": same2,
           "weights_freed_gib": freed2["weights"] / 2**30}
    if free0 is not None:
        out["kv_freed_fraction"] = (free1 - free0) / kv_bytes
        out["level2_freed_fraction"] = (free2 - free2a) / (kv_bytes + freed2["weights"])
    del engine, state
    gc.collect()
    return out


# ---------------------------------------------------------------------- parity
def bench_parity(path: str, size: dict, args) -> dict:
    from transformers import AutoModelForCausalLM

    from actors.engine.llm_engine import Engine

    engine = Engine(path, engine_options(args.dtype, **SMALL_KV))
    rng = np.random.default_rng(2)
    vocab = engine.loaded.vocab_size
    prompts = [rng.integers(10, vocab, int(n)).tolist()
               for n in rng.integers(16, 128, size["requests"])]
    params = {"temperature": 1.0, "max_tokens": size["tokens"], "ignore_eos": True,
              "detokenize": False}
    outs = engine.generate([(i, p, {**params, "seed": i}) for i, p in enumerate(prompts)],
                           token_logprobs=True)
    del engine
    gc.collect()
    refs = {}
    for name, dtype in (("same_dtype", getattr(torch, args.dtype)), ("float32", torch.float32)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     attn_implementation="sdpa").to(DEVICE)
        values = []
        with torch.no_grad():
            for o in outs:
                ids = torch.tensor([prompts[o.id] + o.output_token_ids], device=DEVICE)
                n = len(prompts[o.id])
                logits = model(ids).logits[0, n - 1:-1]
                lp = torch.log_softmax(logits.float(), -1)
                values.append(lp.gather(1, ids[0, n:, None])[:, 0].cpu().numpy())
        refs[name] = np.concatenate(values)
        del model
    engine_lp = np.concatenate([np.asarray(o.raw_logprobs, np.float32) for o in outs])

    def stats(a, b) -> dict:
        d = np.abs(a.astype(np.float64) - b)
        return {"mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max())}

    return {"num_tokens": int(engine_lp.size),
            "engine_vs_hf_same_dtype": stats(engine_lp, refs["same_dtype"]),
            "engine_vs_hf_float32": stats(engine_lp, refs["float32"]),
            "hf_same_dtype_vs_float32": stats(refs["same_dtype"], refs["float32"])}


# ---------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="qwen2-0.5b,llama3-8b" if DEVICE == "cuda"
                        else "tiny", help="comma-separated: " + ", ".join(SPECS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--transport", choices=("ray", "local"), default="ray")
    parser.add_argument("--dtype", default="bfloat16" if DEVICE == "cuda" else "float32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="docs/records")
    parser.add_argument("--tmp", default=None, help="where the random models are saved")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    report = {"device": DEVICE, "dtype": args.dtype, "transport": args.transport,
              "torch": torch.__version__, "results": {}}
    for name in args.workloads.split(","):
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            log(f"{name}: building a random model")
            model = build_model(SPECS[name], Path(tmp))
            result = {}
            if "update" in modes:
                result["update"] = bench_update(tmp, model, args)
                log(f"{name} update: {result['update']}")
            del model
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            # sleep and parity on the small models (the 8B only for update unless asked)
            if "sleep" in modes and (name != "llama3-8b" or args.workloads == name):
                result["sleep"] = bench_sleep(tmp, SIZES.get(name, DEFAULT_SIZE), args)
                log(f"{name} sleep: {result['sleep']}")
            if "parity" in modes and (name != "llama3-8b" or args.workloads == name):
                result["parity"] = bench_parity(tmp, SIZES.get(name, DEFAULT_SIZE), args)
                log(f"{name} parity: {result['parity']}")
            report["results"][name] = result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl_bench.json").write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    main()
