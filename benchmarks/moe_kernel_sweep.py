"""One MoE layer's routed experts alone on the GPU (``moe_bench.py --kernel-sweep``): each
launch of the fused path timed apart over its families and GEMM tiles, the tile table's choice
end to end, and transformers' grouped_mm experts, against the expert-read floor."""

from __future__ import annotations

import json

import numpy as np
import torch

COPY_TBPS = 4.16  # H200: device copy bandwidth


def moe_shape(spec: dict) -> tuple[int, int, int]:
    """(experts, experts per token, expert width)."""
    experts = spec.get("num_experts") or spec["num_local_experts"]
    width = spec.get("moe_intermediate_size") or spec["intermediate_size"]
    return experts, spec["num_experts_per_tok"], width


def _median_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _graph_ms(fn, calls: int = 10, reps: int = 10) -> float:
    """Median device ms of one call of ``fn``, from replays of a CUDA graph of ``calls``
    calls (no host launch time in the figure, as in the engine's graphed decode)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return float(np.median(times))


#: tiles the sweep tries for each GEMM, (block_n, block_k, warps, stages), by orientation
_GATE_UP_TILES = {False: [(128, 64, 4, 4), (64, 128, 4, 4), (128, 64, 8, 4)],
                  True: [(128, 64, 4, 4), (128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3),
                         (64, 64, 4, 4), (64, 128, 4, 3), (128, 32, 4, 6), (256, 64, 8, 3),
                         (128, 64, 8, 4), (64, 64, 2, 4)]}
_DOWN_TILES = {False: [(128, 128, 4, 3), (128, 64, 4, 4)],
               True: [(128, 64, 4, 4), (128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 4),
                      (64, 64, 4, 6), (128, 32, 4, 6), (256, 64, 8, 4), (256, 32, 8, 6),
                      (64, 128, 4, 3), (128, 128, 4, 3)]}
#: (block_m, group_m, swap, tma) of the sweep's families
_FAMILIES = [(64, 8, False, False), (32, 8, True, False), (32, 1, True, False),
             (64, 8, True, False), (64, 1, True, False), (32, 8, True, True),
             (64, 8, True, True), (128, 8, False, False), (128, 8, True, True)]


def _hf_experts(spec: dict, gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' experts module of the model with these weights (its default
    experts implementation, grouped_mm where it can run)."""
    import transformers

    spec = dict(spec)
    arch = spec.pop("arch")
    if arch == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mod
        cfg, cls = transformers.Qwen3MoeConfig(**spec), mod.Qwen3MoeExperts
    else:
        from transformers.models.mixtral import modeling_mixtral as mod
        cfg, cls = transformers.MixtralConfig(**spec), mod.MixtralExperts
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        module = cls(cfg)
    module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return module


def _timed(fn, nbytes: float, graphed: bool = True) -> dict:
    try:
        ms = _graph_ms(fn) if graphed else _median_ms(fn)
    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result
        return {"error": repr(exc)[:200]}
    return {"ms": ms, "tb_s": nbytes / ms / 1e9}


def kernel_sweep(spec: dict, batches: list[int], log=print) -> dict:
    """One MoE layer's routed experts alone for each row count: each launch of the fused path
    timed apart (the sort, the gate/up GEMM, the down GEMM, the sum over a token's experts)
    for each family of :data:`_FAMILIES` and each GEMM tile, the table's tiles end to end,
    and transformers' grouped_mm experts; ms and the expert bytes read per ms (TB/s).
    ``best`` is the fastest family with its fastest tiles (the sum of its launches)."""
    from actors.engine.model.kernels import moe_gemm, moe_tiles
    from actors.engine.model.kernels.moe_align import moe_align
    from actors.engine.model.kernels.moe_sum import sum_pairs

    experts, top_k, width = moe_shape(spec)
    h = spec["hidden_size"]
    layout = moe_gemm.ExpertLayout()
    gate_up = torch.randn(experts, 2 * width, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    down = torch.randn(experts, h, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    hf = _hf_experts(spec, gate_up, down)
    out = {}
    for rows in batches:
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(rows, experts, device="cuda").topk(top_k, -1)[1]
        weights = torch.rand(rows, top_k, device="cuda").softmax(-1).to(torch.bfloat16)
        flat_w = weights.reshape(-1).contiguous()
        touched = float((torch.bincount(ids.flatten(), minlength=experts) > 0).sum())
        gu_bytes, down_bytes = touched * 2 * h * width * 2, touched * h * width * 2
        row = {"experts_touched": touched, "floor_ms": (gu_bytes + down_bytes) / COPY_TBPS / 1e9}
        table = moe_tiles.pick_config(rows * top_k, experts)
        row["table"] = {"config": repr(table), **_timed(
            lambda: moe_gemm.fused_experts(x, ids, weights, gate_up, down, layout),
            gu_bytes + down_bytes)}
        pairs = torch.randn(rows * top_k, h, device="cuda", dtype=torch.bfloat16)
        row["sum"] = _timed(lambda: sum_pairs(pairs, top_k), rows * top_k * h * 2)
        best = None
        for bm, group, swap, tma in _FAMILIES:
            fam = {}
            sorted_pairs, block_expert = moe_align(ids, experts, bm)
            fam["align"] = _timed(lambda: moe_align(ids, experts, bm), 0)
            base = moe_tiles.TileConfig(bm, group, (64, 64, 4, 2), (64, 64, 4, 2), swap, tma)
            hid = moe_gemm.expert_gate_up(x, sorted_pairs, block_expert, top_k, gate_up, layout,
                                          None, base)
            for tile in _GATE_UP_TILES[swap]:
                cfg = moe_tiles.TileConfig(bm, group, tile, base.down, swap, tma)
                fam[f"gate_up{tile}"] = _timed(lambda c=cfg: moe_gemm.expert_gate_up(
                    x, sorted_pairs, block_expert, top_k, gate_up, layout, None, c), gu_bytes)
            for tile in _DOWN_TILES[swap]:
                cfg = moe_tiles.TileConfig(bm, group, base.gate_up, tile, swap, tma)
                fam[f"down{tile}"] = _timed(lambda c=cfg: moe_gemm.expert_down(
                    hid, sorted_pairs, block_expert, flat_w, down, layout, None, c), down_bytes)
            gu = min((v["ms"], k) for k, v in fam.items() if k.startswith("gate_up") and "ms" in v)
            dn = min((v["ms"], k) for k, v in fam.items() if k.startswith("down") and "ms" in v)
            total = fam["align"]["ms"] + gu[0] + dn[0] + row["sum"]["ms"]
            name = f"bm{bm}_g{group}{'_swap' if swap else ''}{'_tma' if tma else ''}"
            fam["total_ms"] = total
            row[name] = fam
            log(f"  {rows} rows {name}: {total:.3f} ms (gate/up {gu}, down {dn})")
            if best is None or total < best["ms"]:
                best = {"ms": total, "family": name, "gate_up": gu[1], "down": dn[1],
                        "tb_s": (gu_bytes + down_bytes) / total / 1e9}
        row["best"] = best
        row["hf_grouped_mm"] = _timed(lambda: hf(x, ids, weights), gu_bytes + down_bytes,
                                      graphed=False)  # its routing syncs with the host
        out[str(rows)] = row
        log(f"  kernels at {rows} rows: floor {row['floor_ms']:.3f} ms, table "
            f"{row['table'].get('ms')}, best {json.dumps(best)}, "
            f"grouped_mm {row['hf_grouped_mm'].get('ms')}")
    del gate_up, down, hf
    torch.cuda.empty_cache()
    return out
