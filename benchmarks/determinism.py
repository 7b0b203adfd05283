"""Batch dependence of logprobs: a seeded request run alone versus inside a batch of 256.

    python benchmarks/determinism.py --out docs/records              # GPU: 0.5B-shaped, bf16
    python benchmarks/determinism.py --workload tiny --out /tmp/det  # CPU smoke test

For each of a few probe requests (seeded sampling, ``raw_logprobs`` and
``temperature_logprobs`` recorded per token), the engine runs the probe alone on a fresh prefix
cache, then again among 252 other requests of random prompt and output lengths (a batch of
256, fresh prefix cache). Reported per engine setting (``batch_invariant`` off and on): the
largest |difference| of the raw and temperature logprobs over the tokens both runs share (up to
the first sampled token that differs), how many probes are bit-identical, and the batch's
output tok/s (the cost of the option).

Where differences come from and what ``batch_invariant`` removes:

- the sampler: nothing to remove; a row's values depend on its logits only (per-row kernels,
  counter-based noise);
- attention: FlashInfer runs with split-KV off, so a decode row's reduction never depends on
  the batch; but in a mixed step a decode token goes through the prefill kernel, whose query
  tile size follows the batch's query lengths, and a prompt's chunking follows the token
  budget left by batch-mates. ``batch_invariant`` makes every step one prompt's prefill chunk
  or pure decode, so a token always meets the same kernel and tiling;
- GEMMs (QKV/O/MLP projections, LM head): cuBLAS picks tiles and split-K by the step's row
  count (padded to the CUDA-graph bucket), so a token's hidden states round differently in a
  batch of 1 and of 256. Not removed by the option: that needs batch-invariant matmul kernels.
  With the option on, what is left is exactly this GEMM term.
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

from e2e_bench import QWEN2_05B, TINY, build_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# name: (model spec, batch size, probes, prompt length range, output length range)
WORKLOADS = {
    "qwen2-0.5b": (QWEN2_05B, 256, 4, (32, 512), (32, 256)),
    "tiny": (TINY, 16, 2, (4, 40), (4, 12)),
}
PROBE = {"qwen2-0.5b": (128, 128), "tiny": (16, 8)}  # probe prompt and output lengths
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "ignore_eos": True, "detokenize": False}


def make_requests(name: str, vocab: int, seed: int = 0):
    """Probe requests and filler requests (random token ids, random lengths)."""
    spec, batch, num_probes, prompt_range, out_range = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    plen, olen = PROBE[name]
    probes = [(f"probe{i}", rng.integers(10, vocab, plen).tolist(),
               {**SAMPLING, "max_tokens": olen, "seed": 100 + i}) for i in range(num_probes)]
    fillers = []
    for i in range(batch - num_probes):
        n = int(rng.integers(*prompt_range))
        fillers.append((f"fill{i}", rng.integers(10, vocab, n).tolist(),
                        {**SAMPLING, "max_tokens": int(rng.integers(*out_range)),
                         "seed": 1000 + i}))
    return probes, fillers


def compare(alone, batched) -> dict:
    """Largest logprob differences over the tokens both runs sampled identically."""
    a, b = alone.output_token_ids, batched.output_token_ids
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    raw = np.abs(np.subtract(alone.raw_logprobs[:same], batched.raw_logprobs[:same]))
    temp = np.abs(np.subtract(alone.temperature_logprobs[:same],
                              batched.temperature_logprobs[:same]))
    return {"shared_tokens": same, "num_tokens": len(a),
            "max_raw_diff": float(raw.max()) if same else 0.0,
            "max_temperature_diff": float(temp.max()) if same else 0.0,
            "bit_identical": a == b and alone.raw_logprobs == batched.raw_logprobs}


def run_setting(path: str, name: str, vocab: int, invariant: bool, args) -> dict:
    from actors.engine.llm_engine import Engine

    _, batch, *_ = WORKLOADS[name]
    engine = Engine(path, {"dtype": args.dtype, "max_num_seqs": batch,
                           "max_num_batched_tokens": args.max_batched_tokens,
                           "max_model_len": 1024, "batch_invariant": invariant,
                           "gpu_memory_utilization": 0.85})
    probes, fillers = make_requests(name, vocab)
    alone = {}
    for rid, prompt, params in probes:
        engine.reset_prefix_cache()
        (alone[rid],) = engine.generate([(rid, prompt, params)], token_logprobs=True)
    engine.reset_prefix_cache()
    requests = probes[: len(probes) // 2] + fillers + probes[len(probes) // 2:]
    t0 = time.perf_counter()
    outs = {o.id: o for o in engine.generate(requests, token_logprobs=True)}
    seconds = time.perf_counter() - t0
    tokens = sum(o.num_output_tokens for o in outs.values())
    per_probe = {rid: compare(alone[rid], outs[rid]) for rid, _, _ in probes}
    result = {
        "batch_invariant": invariant, "batch": len(requests),
        "max_raw_diff": max(p["max_raw_diff"] for p in per_probe.values()),
        "max_temperature_diff": max(p["max_temperature_diff"] for p in per_probe.values()),
        "bit_identical_probes": sum(p["bit_identical"] for p in per_probe.values()),
        "num_probes": len(probes), "batch_output_tok_s": tokens / seconds,
        "attention_backend": engine.info()["attention_backend"],
        "cuda_graphs": engine.info()["cuda_graphs"], "probes": per_probe}
    del engine
    gc.collect()  # the runner and its CUDA graphs reference each other
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS),
                        default="qwen2-0.5b" if DEVICE == "cuda" else "tiny")
    parser.add_argument("--dtype", default="bfloat16" if DEVICE == "cuda" else "float32")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--out", default="docs/records")
    parser.add_argument("--tmp", default=None, help="where the random model is saved")
    args = parser.parse_args(argv)
    spec = WORKLOADS[args.workload][0]
    results = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        model = build_model(spec, Path(tmp))
        del model
        for invariant in (False, True):
            r = run_setting(tmp, args.workload, spec["vocab_size"], invariant, args)
            results.append(r)
            print(f"{args.workload} batch_invariant={invariant}: max |raw diff| "
                  f"{r['max_raw_diff']:.3g}, max |temperature diff| "
                  f"{r['max_temperature_diff']:.3g}, bit-identical probes "
                  f"{r['bit_identical_probes']}/{r['num_probes']}, batch "
                  f"{r['batch_output_tok_s']:.0f} output tok/s", flush=True)
    report = {"workload": args.workload, "device": DEVICE, "dtype": args.dtype,
              "torch": torch.__version__, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "determinism.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
