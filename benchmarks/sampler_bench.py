"""Sampler step latency over a batch x vocab grid, per workload and backend.

One timed step is ``Sampler.sample(logits, slots)`` plus ``AsyncOutput(out).get()`` (the host
has the token ids and logprobs). Medians over ``--iters`` steps after ``--warmup`` steps; the
persistent batch advances every step (positions, counts), as in the engine.

    python benchmarks/sampler_bench.py --device cpu
    python benchmarks/sampler_bench.py --device cuda --batch-sizes 1,32,256 \
        --vocab-sizes 32000,151936 --json docs/sampler_bench_h200.json

Backends are columns: each entry of ``BACKENDS`` builds a Sampler for one backend; one that
this build or machine lacks is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sampler import AsyncOutput, Sampler, SamplingParams, derive_seed  # noqa: E402

EOS = [0]


def _make(backend: str) -> Callable[..., Sampler]:
    def factory(max_num_seqs: int, vocab: int, device: torch.device) -> Sampler:
        return Sampler(max_num_seqs, vocab, device=device, eos_token_ids=EOS, max_logprobs=20,
                       backend=backend)
    return factory


BACKENDS: dict[str, Callable[..., Sampler]] = {
    "torch": _make("torch"),
    "triton": _make("triton"),
    "flashinfer": _make("flashinfer"),
}


def _workload(name: str, row: int, vocab: int, rng: random.Random) -> dict:
    """Per-row request for a workload: SamplingParams plus the add_request extras."""
    seed = derive_seed(0, row)
    if name == "greedy":
        return {"params": SamplingParams(temperature=0.0, seed=seed)}
    if name == "greedy_logprobs":
        return {"params": SamplingParams(temperature=0.0, logprobs=20, seed=seed)}
    if name == "mixed":
        return {"params": SamplingParams(
            temperature=rng.choice([0.0, 0.6, 1.0]), top_k=rng.choice([0, 20, 50]),
            top_p=rng.choice([1.0, 0.9, 0.95]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.1]),
            logprobs=rng.choice([None, None, 0, 5]), seed=seed)}
    if name == "full":
        return {
            "params": SamplingParams(
                temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                frequency_penalty=0.2, presence_penalty=0.1, min_tokens=4,
                stop_token_ids=[1, 2], logit_bias={3: 1.0, 4: -1.0}, logprobs=20,
                logprobs_mode=rng.choice(["raw_logprobs", "processed_logprobs"]), seed=seed),
            "bad_words": [[5], [6, 7], [8, 9, 10]],
            "prompt": [rng.randrange(vocab) for _ in range(256)],
        }
    raise ValueError(f"--workloads: unknown workload {name!r}")


WORKLOADS = ("greedy", "greedy_logprobs", "mixed", "full")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(backend: str, workload: str, batch: int, vocab: int, device: torch.device,
              dtype: torch.dtype, warmup: int, iters: int) -> dict:
    record = {"backend": backend, "workload": workload, "batch": batch, "vocab": vocab,
              "device": device.type, "dtype": str(dtype).replace("torch.", "")}
    try:
        sampler = BACKENDS[backend](batch, vocab, device)
    except ValueError as exc:  # a backend this build or machine does not provide
        return {**record, "skipped": str(exc)}
    rng = random.Random(batch * 7 + vocab)
    for slot in range(batch):
        req = _workload(workload, slot, vocab, rng)
        sampler.add_request(slot, req["params"], req.get("prompt", [1, 2, 3]),
                            seed=req["params"].seed,
                            bad_words_token_ids=req.get("bad_words", ()))
    slots = torch.arange(batch, dtype=torch.int64)
    g = torch.Generator(device="cpu").manual_seed(0)
    source = (torch.randn(batch, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    work = torch.empty_like(source)
    times = []
    for step in range(warmup + iters):
        work.copy_(source)  # float32 logits are overwritten in place by the sampler
        _sync(device)
        start = time.perf_counter()
        AsyncOutput(sampler.sample(work, slots)).get()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed * 1e3)
    times.sort()
    return {**record, "iters": iters, "median_ms": statistics.median(times),
            "p10_ms": times[len(times) // 10], "p90_ms": times[(len(times) * 9) // 10]}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--backends", default="torch", help="comma list of " + ",".join(BACKENDS))
    ap.add_argument("--batch-sizes", type=_ints, default=None,
                    help="comma list (default: 1,8 on cpu; 1,8,64,256 on cuda)")
    ap.add_argument("--vocab-sizes", type=_ints, default=None,
                    help="comma list (default: 32000 on cpu; 32000,151936 on cuda)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (cpu)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None, help="write the records here")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.batch_sizes is None:
        args.batch_sizes = [1, 8, 64, 256] if cuda else [1, 8]
    if args.vocab_sizes is None:
        args.vocab_sizes = [32000, 151936] if cuda else [32000]
    for name in args.backends.split(","):
        if name not in BACKENDS:
            ap.error(f"--backends: unknown backend {name!r}")
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {name!r}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    return args


def format_table(records: list[dict], backends: list[str]) -> str:
    """One line per (workload, batch, vocab), one median column per backend (ms)."""
    head = f"{'workload':<16}{'batch':>6}{'vocab':>8}" + "".join(f"{b:>14}" for b in backends)
    lines = [head, "-" * len(head)]
    keys = sorted({(r["workload"], r["batch"], r["vocab"]) for r in records},
                  key=lambda k: (WORKLOADS.index(k[0]), k[1], k[2]))
    for key in keys:
        cells = []
        for b in backends:
            rec = next((r for r in records if (r["workload"], r["batch"], r["vocab"]) == key
                        and r["backend"] == b), None)
            cells.append("n/a" if rec is None or "skipped" in rec else f"{rec['median_ms']:.3f}")
        lines.append(f"{key[0]:<16}{key[1]:>6}{key[2]:>8}" + "".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    backends = args.backends.split(",")
    records = []
    for workload in args.workloads.split(","):
        for batch in args.batch_sizes:
            for vocab in args.vocab_sizes:
                for backend in backends:
                    records.append(bench_one(backend, workload, batch, vocab, device, dtype,
                                             args.warmup, args.iters))
    print(f"sampler step, median ms ({device}, {args.dtype}, {args.iters} iters, "
          f"torch {torch.__version__})")
    print(format_table(records, backends))
    for rec in records:
        if "skipped" in rec:
            print(f"skipped {rec['backend']}: {rec['skipped']}")
            break
    if args.json is not None:
        meta = {"device": str(device), "dtype": args.dtype, "torch": torch.__version__,
                "python": platform.python_version(), "machine": platform.machine(),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
