"""Sampler step latency over a batch x vocab grid, per workload and backend.

One timed step is ``Sampler.sample(logits, slots)`` plus ``AsyncOutput(out).get()`` (the host
has the token ids and logprobs). Medians over ``--iters`` steps after ``--warmup`` steps; the
persistent batch advances every step (positions, counts), as in the engine.

On CUDA more figures are taken per entry: ``gpu_ms``, the device time of the step's work
between CUDA events, with the stream held busy by a sleep kernel while the host enqueues (so
host launch gaps are not counted: the engine overlaps them with the model), on the same bf16
logits every step (as ``--flashinfer-alone`` measures FlashInfer); ``gpu_fresh_ms``, the same
with the logits copied in just before each step (outside the events), as an LM head leaves
them (the step then also pays for the write-back of the copy's dirty L2 lines; float32
logits, which the step overwrites, are always measured so); and ``peak_mb``,
the peak extra device memory of a step (``torch.cuda.max_memory_allocated``) next to the bf16
logits size. ``--flashinfer-alone`` adds FlashInfer's ``top_k_top_p_sampling_from_logits`` on
the same logits (top-k 50, top-p 0.9) as a reference column.

    python benchmarks/sampler_bench.py --device cpu
    python benchmarks/sampler_bench.py --device cuda --batch-sizes 1,32,256 \
        --vocab-sizes 32000,151936 --json docs/records/sampler_bench_h200.json

Backends are columns: each entry of ``BACKENDS`` builds a Sampler for one backend ("flashinfer"
is our whole pipeline on the FlashInfer backend; its records count the steps that fell back);
one that this build or machine lacks is reported as skipped.
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
    if name == "greedy_sampled_logprob":
        return {"params": SamplingParams(temperature=0.0, logprobs=0, seed=seed)}
    if name == "top_p":
        return {"params": SamplingParams(temperature=1.0, top_p=0.9, seed=seed)}
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
                seed=seed),
            "bad_words": [[5], [6, 7], [8, 9, 10]],
            "prompt": [rng.randrange(vocab) for _ in range(256)],
        }
    raise ValueError(f"--workloads: unknown workload {name!r}")


WORKLOADS = ("greedy", "greedy_sampled_logprob", "greedy_logprobs", "top_p", "mixed", "full")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_time_ms(fn: Callable[[], object], iters: int, device: torch.device,
                 ahead_ms: float = 1.0, before: Callable[[], object] | None = None
                 ) -> list[float]:
    """Device time of ``fn`` per call (CUDA events; the stream is kept busy by a sleep of
    about ``ahead_ms`` so the host's enqueue time is hidden: pass more than the host time of
    ``fn``). ``before``: work queued after the sleep and before the start event (not timed)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2_000_000 * ahead_ms))  # ~2e6 cycles a millisecond
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench_flashinfer_alone(batch: int, vocab: int, device: torch.device, dtype: torch.dtype,
                           warmup: int, iters: int) -> dict:
    """FlashInfer's top-k/top-p sampling from logits alone (k=50, p=0.9) on the same logits."""
    record = {"backend": "flashinfer_alone", "workload": "full", "batch": batch,
              "vocab": vocab, "device": device.type, "dtype": str(dtype).replace("torch.", "")}
    try:
        import flashinfer.sampling as fs
    except ImportError as exc:
        return {**record, "skipped": f"flashinfer: {exc}"}
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    top_k = torch.full((batch,), 50, dtype=torch.int32, device=device)
    top_p = torch.full((batch,), 0.9, dtype=torch.float32, device=device)

    def step():
        return fs.top_k_top_p_sampling_from_logits(logits, top_k, top_p)
    try:
        for _ in range(max(warmup, 1)):
            step()
    except Exception as exc:  # dtype support differs between releases
        logits = logits.float()
        record["note"] = f"fp32 logits ({type(exc).__name__})"
        step()
    torch.cuda.synchronize(device)
    times = sorted(_gpu_time_ms(step, iters, device))
    return {**record, "iters": iters, "median_ms": statistics.median(times),
            "gpu_ms": statistics.median(times)}


def _triton_variant(name: str) -> None:
    """``triton@BLOCKxWARPS[xCAP][nfsouwa][vVEC][kBxW[xC]][qBxW[xC]][eW]`` selects a launch
    config of the kernels (a tuning sweep): n = per-lane bin counts instead of tl.histogram,
    f = no skipping of empty tiles in the sampling pass, s = the exact selection passes always
    (no draw-then-verify), o = no greedy split (all-greedy steps without top-k logprobs in the
    fused kernel alone), u = no prefetch of the next tile in the row-pass loops, w = two tiles
    ahead, a = no candidate path (``sampler.kernels.candidate_stats``: every row in the fused
    kernel, all-greedy steps on the greedy split), vVEC = tokens per thread and tile row,
    kBxW[xC] = tiles of B tokens and W warps (and vocab chunks of C tokens) for the greedy
    split's kernels, qBxW[xC] = the same for the candidate path's statistics kernel, eW = W
    warps for its finish kernel."""
    import re

    if name.startswith("triton"):
        from sampler.kernels.kernel_config import LaunchConfig, set_launch_config

        if "@" in name:
            spec = name.split("@")[1]
            m = re.fullmatch(r"(?P<block>\d+)x(?P<warps>\d+)(?:x(?P<cap>\d+))?(?P<flags>[nfsouwa]*)"
                             r"(?:v(?P<vec>\d+))?(?:k(?P<kb>\d+)x(?P<kw>\d+)(?:x(?P<kc>\d+))?)?"
                             r"(?:q(?P<qb>\d+)x(?P<qw>\d+)(?:x(?P<qc>\d+))?)?(?:e(?P<ew>\d+))?",
                             spec)
            if m is None:
                raise ValueError(f"--backends: bad triton variant {name!r}")
            flags = m["flags"]
            kw = dict(block=int(m["block"]), num_warps=int(m["warps"]), hist="n" not in flags,
                      skip="f" not in flags, fast="s" not in flags,
                      greedy_split="o" not in flags, cand="a" not in flags,
                      prefetch=0 if "u" in flags else 2 if "w" in flags else 1)
            fields = dict(cap="cap", vec="vec", chunk_block="kb", chunk_warps="kw", chunk="kc",
                          cand_block="qb", cand_warps="qw", cand_chunk="qc",
                          cand_finish_warps="ew")
            kw.update({field: int(m[group]) for field, group in fields.items() if m[group]})
            set_launch_config(LaunchConfig(**kw))
        else:
            set_launch_config(None)


def bench_one(backend: str, workload: str, batch: int, vocab: int, device: torch.device,
              dtype: torch.dtype, warmup: int, iters: int, device_slots: bool = False) -> dict:
    _triton_variant(backend)
    record = {"backend": backend, "workload": workload, "batch": batch, "vocab": vocab,
              "device": device.type, "dtype": str(dtype).replace("torch.", "")}
    try:
        sampler = BACKENDS[backend.split("@")[0]](batch, vocab, device)
    except ValueError as exc:  # a backend this build or machine does not provide
        return {**record, "skipped": str(exc)}
    rng = random.Random(batch * 7 + vocab)
    for slot in range(batch):
        req = _workload(workload, slot, vocab, rng)
        params = req["params"]  # the request sets no seed of its own (the slot gets the
        # derived one): a request's own seed would keep the flashinfer backend off the step
        sampler.add_request(slot, params.replace(seed=-1), req.get("prompt", [1, 2, 3]),
                            seed=params.seed, bad_words_token_ids=req.get("bad_words", ()))
    slots = torch.arange(batch, dtype=torch.int64)
    # --device-slots: a device copy of the slots comes with the step (as the engine's, uploaded
    # with its step inputs), so the sampler makes no host-to-device copy of its own
    extra = {"device_slots": slots.to(device)} if device_slots else {}
    record["slots"] = "device" if device_slots else "host"
    g = torch.Generator(device="cpu").manual_seed(0)
    source = (torch.randn(batch, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    work = torch.empty_like(source)
    times = []
    for step in range(warmup + iters):
        work.copy_(source)  # float32 logits are overwritten in place by the sampler
        _sync(device)
        start = time.perf_counter()
        AsyncOutput(sampler.sample(work, slots, **extra)).get()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed * 1e3)
    times.sort()
    if hasattr(sampler._run, "num_fallback_steps"):  # flashinfer: steps it left to triton/torch
        record["fallback_steps"] = sampler._run.num_fallback_steps
    record.update({"iters": iters, "median_ms": statistics.median(times),
                   "p10_ms": times[len(times) // 10], "p90_ms": times[(len(times) * 9) // 10]})
    if device.type == "cuda":
        # the queued sleep outlasts the step's host time (its median above, reading back
        # included) three times over: no launch gap inside the measured step
        ahead = max(1.0, 3 * record["median_ms"])
        step = lambda: sampler.sample(work, slots, **extra)  # noqa: E731
        # gpu_fresh_ms: the logits written just before the step (restored by a copy before
        # the start event), as an LM head leaves them: the step also pays for writing back
        # the copy's dirty L2 lines
        record["gpu_fresh_ms"] = statistics.median(
            _gpu_time_ms(step, iters, device, ahead, before=lambda: work.copy_(source)))
        if dtype == torch.float32:  # the step overwrites float32 logits: always restored
            record["gpu_ms"] = record["gpu_fresh_ms"]
        else:  # gpu_ms: the same logits every step (never written), as flashinfer_alone
            record["gpu_ms"] = statistics.median(_gpu_time_ms(step, iters, device, ahead))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = sampler.sample(work, slots, **extra)
        torch.cuda.synchronize(device)
        record["peak_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        record["logits_bf16_mb"] = batch * vocab * 2 / 2**20
        del out
    return record


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
    ap.add_argument("--device-slots", action="store_true",
                    help="pass the step's slots as a device copy too (as the engine does)")
    ap.add_argument("--flashinfer-alone", action="store_true",
                    help="add FlashInfer's top_k_top_p_sampling_from_logits alone (cuda)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.batch_sizes is None:
        args.batch_sizes = [1, 8, 64, 256] if cuda else [1, 8]
    if args.vocab_sizes is None:
        args.vocab_sizes = [32000, 151936] if cuda else [32000]
    for name in args.backends.split(","):
        if name.split("@")[0] not in BACKENDS:
            ap.error(f"--backends: unknown backend {name!r}")
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {name!r}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    return args


def format_table(records: list[dict], backends: list[str], field: str = "median_ms") -> str:
    """One line per (workload, batch, vocab), one column per backend (``field``, ms)."""
    head = f"{'workload':<16}{'batch':>6}{'vocab':>8}" + "".join(f"{b:>14}" for b in backends)
    lines = [head, "-" * len(head)]
    keys = sorted({(r["workload"], r["batch"], r["vocab"]) for r in records},
                  key=lambda k: (WORKLOADS.index(k[0]), k[1], k[2]))
    for key in keys:
        cells = []
        for b in backends:
            rec = next((r for r in records if (r["workload"], r["batch"], r["vocab"]) == key
                        and r["backend"] == b), None)
            ok = rec is not None and "skipped" not in rec and field in rec
            cells.append(f"{rec[field]:.3f}" if ok else "n/a")
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
                                             args.warmup, args.iters, args.device_slots))
                    print(json.dumps(records[-1]), flush=True)
                if args.flashinfer_alone and workload == "full" and device.type == "cuda":
                    records.append(bench_flashinfer_alone(batch, vocab, device, dtype,
                                                          args.warmup, args.iters))
                    print(json.dumps(records[-1]), flush=True)
    if args.flashinfer_alone:
        backends = backends + ["flashinfer_alone"]
    print(f"sampler step, host median ms ({device}, {args.dtype}, {args.iters} iters, "
          f"torch {torch.__version__})")
    print(format_table(records, backends))
    if device.type == "cuda":
        print("\nsampler step, GPU median ms (CUDA events, host gaps hidden)")
        print(format_table(records, backends, "gpu_ms"))
        print("\nthe same, logits written just before each step")
        print(format_table(records, backends, "gpu_fresh_ms"))
        print("\npeak extra device memory of a step, MB")
        print(format_table(records, backends, "peak_mb"))
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
