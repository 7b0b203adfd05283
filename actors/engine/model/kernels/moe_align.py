"""Sorting (token, expert) pairs by expert into blocks of ``block_m`` rows, on the device in
one kernel with static output shapes (CUDA-graph capturable, no host sync).

Pair ``p = token * top_k + j`` is token ``token``'s ``j``-th expert. Each expert's pairs get
consecutive rows, its row count padded up to a multiple of ``block_m`` with the sentinel
``num_pairs``; ``block_expert[b]`` is the expert of rows ``b * block_m ...`` (-1 past the
last used block). Within an expert, pairs keep their order (stable). The grouped GEMMs
(:mod:`actors.engine.model.kernels.moe_gemm`) read one expert's weights per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the padded layout can need (every expert padding a partial block)."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)


def moe_align_torch(expert_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: ``(sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks]
    int32)`` of the flat ``expert_ids [num_pairs]`` (rows past the used blocks hold the
    sentinel)."""
    flat = expert_ids.reshape(-1).long()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32,
                              device=flat.device)
    block_expert = torch.full((blocks,), -1, dtype=torch.int32, device=flat.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True)[1]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first[flat[order]]
    sorted_pairs[starts[flat[order]] + rank] = order.to(torch.int32)
    for e in range(num_experts):
        lo, n = int(starts[e]) // block_m, int(padded[e]) // block_m
        block_expert[lo:lo + n] = e
    return sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_blocks,
                  BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                  ONE_TILE: tl.constexpr):
    e = tl.program_id(0)
    bins = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, BLOCK_S)
    # every program counts all experts' pairs; with ONE_TILE they are read once, into
    # registers, and ranked from there
    if ONE_TILE:
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        counts = tl.histogram(ids, BLOCK_E, mask=valid)
    else:
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, num_pairs, BLOCK_S):
            pos = start + offs
            ids = tl.load(ids_ptr + pos, mask=pos < num_pairs, other=0).to(tl.int32)
            counts += tl.histogram(ids, BLOCK_E, mask=pos < num_pairs)
    padded = (counts + BM - 1) // BM * BM
    begin = tl.sum(tl.where(bins < e, padded, 0), 0)
    mine = tl.sum(tl.where(bins == e, counts, 0), 0)
    mine_padded = tl.sum(tl.where(bins == e, padded, 0), 0)
    # this expert's pairs, in order
    if ONE_TILE:
        hit = (ids == e) & valid
        rank = tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + begin + rank, offs.to(tl.int32), mask=hit)
    else:
        seen = 0
        for start in range(0, num_pairs, BLOCK_S):
            pos = start + offs
            ids = tl.load(ids_ptr + pos, mask=pos < num_pairs, other=-1)
            hit = ids == e
            rank = tl.cumsum(hit.to(tl.int32), 0) - 1 + seen
            tl.store(sorted_ptr + begin + rank, pos.to(tl.int32), mask=hit)
            seen += tl.sum(hit.to(tl.int32), 0)
    rows = tl.arange(0, BM)
    for pad in range(mine, mine_padded, BM):
        tl.store(sorted_ptr + begin + pad + rows, num_pairs,
                 mask=pad + rows < mine_padded)
    for b in range(begin // BM, (begin + mine_padded) // BM, BM):
        tl.store(block_expert_ptr + b + rows, e, mask=b + rows < (begin + mine_padded) // BM)
    if e == 0:  # the unused tail of the block list
        total = tl.sum(padded, 0) // BM
        for b in range(total, num_blocks, BM):
            tl.store(block_expert_ptr + b + rows, -1, mask=b + rows < num_blocks)


def pair_tile(num_pairs: int) -> tuple[int, bool, int]:
    """``(BLOCK_S, ONE_TILE, num_warps)`` of :func:`moe_align`'s launch: pairs are read in
    tiles of 1,024, or of 8,192 past that (a decode step's 1,024 tokens x 8 experts in one
    tile: the kernel's time is the latency of its passes over the tiles, not their work)."""
    block = 1024 if num_pairs <= 1024 else 8192
    return block, num_pairs <= block, 4 if block == 1024 else 8


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_align_torch` in one kernel (one program per expert).

    Rows past the last used block are left unwritten (the GEMMs skip their blocks).

    Args:
        expert_ids: ``[T, k]`` (or flat) expert of each pair, int32 or int64.
        num_experts: ``E``; ids must lie in ``[0, E)``.
        block_m: rows per block (a power of two >= 16).

    Returns:
        ``(sorted_pairs, block_expert)`` as in :func:`moe_align_torch`.
    """
    flat = expert_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    block, one_tile, warps = pair_tile(num_pairs)
    _align_kernel[(num_experts,)](
        flat, sorted_pairs, block_expert, num_pairs, blocks, BM=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_S=block, ONE_TILE=one_tile,
        num_warps=warps)
    return sorted_pairs, block_expert
