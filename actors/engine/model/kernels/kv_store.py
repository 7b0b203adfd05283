"""A step's new K/V rows into the paged KV pool in one kernel, keys and values in one launch:
into an FP8 (e4m3) pool each row is clamped to +-448 and rounded to e4m3 (nearest, ties to
even, as torch casts); into a pool of the rows' own dtype it is copied. The oracle is
``actors.engine.model.kv_cache.store_rows`` (clamp, cast, ``index_copy_``), which every other
pool and device uses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.fp8_quant import e4m3

__all__ = ["store_kv_rows"]


@triton.jit
def _store_row(src_ptr, dst_ptr, t, dst_row, heads, dims, src_t, src_h, dst_row_stride,
               dst_h, mask, FP8: tl.constexpr):
    x = tl.load(src_ptr + t * src_t + heads[:, None] * src_h + dims[None, :], mask=mask,
                other=0.0)
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        x = e4m3(x, dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + dst_row * dst_row_stride + heads[:, None] * dst_h + dims[None, :], x,
             mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, flat_ptr, k_rows_ptr, v_rows_ptr, H, D,
                     k_t, k_h, v_t, v_h, f_row, f_h,
                     BH: tl.constexpr, BD: tl.constexpr, FP8: tl.constexpr):
    """Programs ``(token, 0 keys / 1 values)``."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BH)
    dims = tl.arange(0, BD)
    mask = (heads < H)[:, None] & (dims < D)[None, :]
    if tl.program_id(1) == 0:
        row = tl.load(k_rows_ptr + t).to(tl.int64)
        _store_row(k_ptr, flat_ptr, t, row, heads, dims, k_t, k_h, f_row, f_h, mask, FP8)
    else:
        row = tl.load(v_rows_ptr + t).to(tl.int64)
        _store_row(v_ptr, flat_ptr, t, row, heads, dims, v_t, v_h, f_row, f_h, mask, FP8)


def store_kv_rows(flat: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor) -> None:
    """``flat[k_rows[i]] = key[i]``, ``flat[v_rows[i]] = value[i]`` (e4m3 of them into an FP8
    pool).

    Args:
        flat: ``[rows, kv_heads, D]`` pool rows (unit last stride), e4m3 or of ``key``'s dtype.
        k_rows, v_rows: ``[T]`` integer rows of ``flat``.
        key, value: ``[T, kv_heads, D]`` of one float dtype (unit last stride; any float dtype
            into an e4m3 pool).
    """
    fp8 = flat.dtype == torch.float8_e4m3fn
    if (not fp8 and not flat.dtype == key.dtype == value.dtype) or flat.dim() != 3 or \
            flat.stride(-1) != 1:
        raise ValueError(f"flat: expected [rows, heads, D] rows, e4m3 or of the keys' dtype "
                         f"{key.dtype}, got {flat.dtype} {tuple(flat.shape)} strides "
                         f"{flat.stride()}")
    tokens, heads, dim = key.shape
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    if tokens:
        _store_kv_kernel[(tokens, 2)](
            key, value, flat, k_rows, v_rows, heads, dim, key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), flat.stride(0), flat.stride(1),
            BH=triton.next_power_of_2(heads), BD=triton.next_power_of_2(dim), FP8=fp8,
            num_warps=4)
