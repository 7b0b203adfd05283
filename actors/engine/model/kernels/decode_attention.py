"""Paged decode attention in Triton: one query token per row over its cached keys and values.

The pages are the KV pool's layer view ``[pages, 2, block_size, kv_heads, head_dim]`` (keys
then values of a page; bf16, or e4m3 with scale 1.0), a row's pages come in CSR form (FlashInfer's
``indptr`` / ``indices`` / ``last_page_len``). One program takes one row, one KV head (its
``heads / kv_heads`` query heads together, one matrix product per key block) and one chunk of
``chunk`` positions; a row whose context fits one chunk is written in that pass, a longer one
leaves a partial result (running max, sum, weighted values) per chunk for
:func:`_combine_kernel`. The chunks are fixed by position, so a row's result depends on its own
keys alone: not on the batch, the grid or the CUDA-graph bucket it runs in. Scores and the
softmax are float32; the probabilities meet the values in the query's dtype (as FlashInfer's
kernels do; under the CPU interpreter the products run on float32 copies of the same bf16
values). :func:`decode_attention_reference` is the torch oracle.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels import interpreted

__all__ = ["decode_attention", "decode_attention_reference", "decode_chunk"]

_LOG2E = 1.4426950408889634


def decode_chunk(max_model_len: int, max_splits: int = 16) -> int:
    """Positions per chunk for contexts up to ``max_model_len``: a power of two, at least 512
    (a grid's chunks past a row's context still take the SMs' turns), so that a row never needs
    more than ``max_splits`` chunks."""
    return max(512, triton.next_power_of_2(math.ceil(max_model_len / max_splits)))


def decode_attention_reference(query: torch.Tensor, pages: torch.Tensor, indptr: torch.Tensor,
                               indices: torch.Tensor, last_page_len: torch.Tensor,
                               sm_scale: float) -> torch.Tensor:
    """Float32 attention of each row's query ``[B, H, D]`` over its pages; ``[B, H, D]`` in
    the query's dtype."""
    num_rows, num_heads, dim = query.shape
    block_size, num_kv = pages.shape[2], pages.shape[3]
    group = num_heads // num_kv
    out = torch.empty_like(query)
    for b in range(num_rows):
        ids = indices[int(indptr[b]):int(indptr[b + 1])].long()
        length = (len(ids) - 1) * block_size + int(last_page_len[b])
        k = pages[ids, 0].reshape(-1, num_kv, dim)[:length].float()  # [L, Hkv, D]
        v = pages[ids, 1].reshape(-1, num_kv, dim)[:length].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[b].float()                                          # [H, D]
        scores = torch.einsum("hd,lhd->hl", q, k) * sm_scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out


@triton.jit
def _chunk_kernel(q_ptr, kv_ptr, indptr_ptr, indices_ptr, last_ptr, out_ptr, part_ptr, ml_ptr,
                  qk_scale, stride_qb, stride_qh, stride_ob, stride_oh,
                  page_stride, kv_stride, tok_stride,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                  UPCAST: tl.constexpr, F16: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    p0 = tl.load(indptr_ptr + b)
    length = (tl.load(indptr_ptr + b + 1) - p0 - 1) * BS + tl.load(last_ptr + b)
    start = s * CHUNK
    if start < length:
        end = tl.minimum(start + CHUNK, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = h * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < G)[:, None], other=0.0)
        if F16:  # e4m3 pages: products in fp16 (e4m3 converts to it exactly and fast)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            valid = t < end
            page = tl.load(indices_ptr + p0 + t // BS, mask=valid, other=0).to(tl.int64)
            row = page * page_stride + (t % BS) * tok_stride + h * D
            k = tl.load(kv_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(kv_ptr + kv_stride + row[:, None] + d[None, :], mask=valid[:, None],
                        other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            if UPCAST:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                                input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))  # log2 units
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            p = p.to(q.dtype)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32),
                                                    input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m = m_new
        keep = (g < G)[:, None]
        if end - start == length:  # the whole context in this chunk: the final result
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=keep)
        else:
            part = (b * G * tl.num_programs(1) + heads) * SPLITS + s
            tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=keep)
            tl.store(ml_ptr + part * 2, m, mask=g < G)
            tl.store(ml_ptr + part * 2 + 1, l, mask=g < G)


@triton.jit
def _combine_kernel(indptr_ptr, last_ptr, out_ptr, part_ptr, ml_ptr, stride_ob, stride_oh,
                    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr,
                    SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p0 = tl.load(indptr_ptr + b)
    length = (tl.load(indptr_ptr + b + 1) - p0 - 1) * BS + tl.load(last_ptr + b)
    n = tl.cdiv(length, CHUNK)
    if n > 1:
        s = tl.arange(0, SPLITS)
        base = (b * H + h) * SPLITS
        m = tl.load(ml_ptr + (base + s) * 2, mask=s < n, other=float("-inf"))
        l = tl.load(ml_ptr + (base + s) * 2 + 1, mask=s < n, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(s < n, tl.exp2(m - top), 0.0)
        d = tl.arange(0, D)
        acc = tl.load(part_ptr + (base + s)[:, None] * D + d[None, :], mask=(s < n)[:, None],
                      other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(query: torch.Tensor, pages: torch.Tensor, indptr: torch.Tensor,
                     indices: torch.Tensor, last_page_len: torch.Tensor, sm_scale: float,
                     chunk: int, max_splits: int, block_n: int = 64,
                     num_warps: int = 2, num_stages: int = 2) -> torch.Tensor:
    """Attention of each row's query over its pages (see the module docstring).

    Args:
        query: ``[B, H, D]`` (bf16 or fp16; head rows may be strided).
        pages: ``[N, 2, block_size, kv_heads, D]``, the layer's KV pages (query dtype or e4m3).
        indptr, indices, last_page_len: the rows' pages in CSR form (int32, on the device).
        sm_scale: the softmax scale.
        chunk: positions per program (:func:`decode_chunk`).
        max_splits: chunks of the longest context allowed (the grid's third dimension: a fixed
            value keeps a CUDA graph's launch valid for any contexts up to it).
    Returns:
        ``[B, H, D]`` in the query's dtype.
    """
    num_rows, num_heads, dim = query.shape
    _, two, block_size, num_kv, page_dim = pages.shape
    assert two == 2 and page_dim == dim and num_heads % num_kv == 0 and pages.stride(-1) == 1
    assert query.stride(-1) == 1 and pages.stride(3) == dim and block_n % block_size == 0
    group = num_heads // num_kv
    out = torch.empty_like(query)
    splits = triton.next_power_of_2(max(1, max_splits))
    if max_splits > 1:
        part = torch.empty((num_rows * num_heads * splits, dim), dtype=torch.float32,
                           device=query.device)
        ml = torch.empty((num_rows * num_heads * splits, 2), dtype=torch.float32,
                         device=query.device)
    else:
        part = ml = out  # never written: every context fits its one chunk
    qk_scale = sm_scale * _LOG2E
    _chunk_kernel[(num_rows, num_kv, max_splits)](
        query, pages, indptr, indices, last_page_len, out, part, ml, qk_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        pages.stride(0), pages.stride(1), pages.stride(2),
        G=group, GP=max(16, triton.next_power_of_2(group)), D=dim, BS=block_size,
        BLOCK_N=block_n, CHUNK=chunk, SPLITS=splits, UPCAST=interpreted(),
        F16=pages.dtype == torch.float8_e4m3fn, num_warps=num_warps, num_stages=num_stages)
    if max_splits > 1:
        _combine_kernel[(num_rows, num_heads)](
            indptr, last_page_len, out, part, ml, out.stride(0), out.stride(1),
            H=num_heads, D=dim, BS=block_size, CHUNK=chunk, SPLITS=splits)
    return out
