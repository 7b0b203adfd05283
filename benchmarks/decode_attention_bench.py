"""Paged decode attention alone: the Triton kernel over its tiles against FlashInfer's
tensor-core decode and the KV read floor, on random pages in random order.

    python3 benchmarks/decode_attention_bench.py --out $OUT/attn            # both shapes (GPU)
    python3 benchmarks/decode_attention_bench.py --shapes qwen2-0.5b --quick
    TRITON_INTERPRET=1 python benchmarks/decode_attention_bench.py --shapes tiny --quick  # CPU

Per shape (rows, query / KV heads, head dim, context range; 16-token pages): each
(keys a block, warps, stages, chunk) of the sweep timed alone, its output checked against the
engine's tile: ``us`` from CUDA events around the replay of a CUDA graph of 20 calls (as the
engine's graphed decode step runs it, no launch cost), ``eager_us`` around 20 calls launched
one by one, each the median of 5; FlashInfer (when installed) on the same pages, launched
eagerly; the floor is the pages' bytes at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.model.kernels.decode_attention import decode_attention  # noqa: E402

SHAPES = {  # rows, heads, kv heads, head dim, shortest and longest context
    "qwen2-0.5b": (1024, 14, 2, 64, 129, 256),
    "llama-3-8b": (512, 32, 8, 128, 257, 512),
    "tiny": (4, 4, 2, 16, 20, 70),  # a smoke run (the CPU under TRITON_INTERPRET=1)
}
BLOCK_SIZE = 16
ENGINE_TILE = (64, 2, 2)  # decode_attention's defaults: keys a block, warps, stages


def pages_of(rows: int, kv_heads: int, dim: int, lo: int, hi: int, dev: torch.device):
    """Random bf16 pages, each row's in random places: (pages, indptr, indices, last, bytes)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=gen)
    counts = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    total = int(counts.sum())
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.zeros(rows + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    last = (lengths - (counts - 1) * BLOCK_SIZE).to(torch.int32)
    pages = torch.randn(total, 2, BLOCK_SIZE, kv_heads, dim, generator=gen).to(torch.bfloat16)
    kv_bytes = int(lengths.sum()) * kv_heads * dim * 2 * 2
    return (pages.to(dev), indptr.to(dev), indices.to(dev), last.to(dev), kv_bytes)


def time_us(fn, calls: int = 20, reps: int = 5, graph: bool = False) -> float:
    """Microseconds a call: CUDA events around ``calls`` calls, the median of ``reps`` (the
    host's clock on the CPU). ``graph``: the calls captured once in a CUDA graph and the
    events around its replays, so the host's launches are not in the figure."""
    fn()
    if not torch.cuda.is_available():
        return statistics.median(_host_us(fn) for _ in range(reps))
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(calls):
            fn()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a call on a side stream before the capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run()
        run = cuda_graph.replay
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _host_us(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e6


def copy_tbps(dev: torch.device) -> float:
    src = torch.empty(1 << (30 if dev.type == "cuda" else 24), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), calls=10)
    return 2 * src.numel() / (us * 1e-6) / 1e12


def flashinfer_us(q, pages, indptr, indices, last, heads, kv_heads, dim, scale):
    try:
        import flashinfer
    except ImportError:
        return None
    if not q.is_cuda:
        return None
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True,
                                                            backend="fa2")
    wrapper.plan(indptr, indices, last, heads, kv_heads, dim, BLOCK_SIZE,
                 q_data_type=q.dtype, kv_data_type=pages.dtype, sm_scale=scale)
    return time_us(lambda: wrapper.run(q, pages))


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sweep(name: str, quick: bool, tbps: float) -> dict:
    rows, heads, kv_heads, dim, lo, hi = SHAPES[name]
    dev = _device()
    pages, indptr, indices, last, kv_bytes = pages_of(rows, kv_heads, dim, lo, hi, dev)
    q = torch.randn(rows, heads, dim, device=dev).to(torch.bfloat16)
    scale = dim ** -0.5
    floor_us = kv_bytes / (tbps * 1e12) * 1e6
    ref = decode_attention(q, pages, indptr, indices, last, scale, chunk=512, max_splits=1,
                           block_n=ENGINE_TILE[0], num_warps=ENGINE_TILE[1],
                           num_stages=ENGINE_TILE[2])
    blocks = (64, 128) if quick else (32, 64, 128)
    warps = (2, 4) if quick else (1, 2, 4)
    stages = (2, 3) if quick else (1, 2, 3)
    chunks = (512,) if quick else (512, 128)
    results = []
    for block_n, nw, ns, chunk in itertools.product(blocks, warps, stages, chunks):
        if chunk < block_n:
            continue
        splits = -(-hi // chunk)

        def call():
            return decode_attention(q, pages, indptr, indices, last, scale, chunk=chunk,
                                    max_splits=splits, block_n=block_n, num_warps=nw,
                                    num_stages=ns)
        try:
            diff = (call().float() - ref.float()).abs().max().item()
            us, eager_us = time_us(call, graph=True), time_us(call)
        except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run (resources)
            print(f"{name} {block_n}/{nw}/{ns}/{chunk}: {type(exc).__name__}", flush=True)
            continue
        results.append({"block_n": block_n, "num_warps": nw, "num_stages": ns, "chunk": chunk,
                        "splits": splits, "us": us, "eager_us": eager_us, "max_abs_diff": diff})
        print(f"{name} block {block_n} warps {nw} stages {ns} chunk {chunk}: {us:.1f} us "
              f"graphed, {eager_us:.1f} eager (diff {diff:.2e})", flush=True)
    best = min(results, key=lambda r: r["us"])
    engine = next(r for r in results if (r["block_n"], r["num_warps"], r["num_stages"],
                                         r["chunk"]) == (*ENGINE_TILE, 512))
    fi = flashinfer_us(q, pages, indptr, indices, last, heads, kv_heads, dim, scale)
    summary = {"shape": dict(zip(("rows", "heads", "kv_heads", "head_dim", "min_context",
                                  "max_context"), SHAPES[name])),
               "kv_read_floor_us": floor_us, "engine_tile_us": engine["us"],
               "engine_tile_eager_us": engine["eager_us"], "best": best,
               "flashinfer_us": fi, "sweep": results}
    print(f"{name}: floor {floor_us:.1f} us, engine tile {engine['us']:.1f} graphed "
          f"({engine['eager_us']:.1f} eager), best "
          f"{best['us']:.1f} ({best['block_n']}/{best['num_warps']}/{best['num_stages']}/"
          f"{best['chunk']}), FlashInfer {fi if fi is None else round(fi, 1)}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--quick", action="store_true", help="a small sweep")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    dev = _device()
    tbps = copy_tbps(dev)
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "copy_tbps": tbps,
              "shapes": {name: sweep(name, args.quick, tbps) for name in args.shapes.split(",")}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_bench.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
