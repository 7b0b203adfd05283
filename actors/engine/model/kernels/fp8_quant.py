"""Dynamic per-token FP8 (e4m3) quantization of activations: each row ``x`` becomes
``q = e4m3(clamp(x * (1 / s), -448, 448))`` with ``s = max(amax(|x|) / 448, SCALE_FLOOR)``
(float32; one division a row, a product an element), so that ``q * s`` approximates ``x``.
The scale is per row, shaped ``[T, 1]`` as ``torch._scaled_mm`` takes it.

The torch oracles live in ``actors.engine.model.quantization.fp8_math`` (no triton there).
``quantize_rows`` is the standalone kernel (the attention output before ``o_proj``, or any input
a fused producer did not quantize); ``row_scale`` / ``to_e4m3`` / ``e4m3`` are the pieces the
fused RMSNorm, SiLU-mul and FP8 KV-store kernels share. On the GPU the cast to e4m3 rounds to
nearest even, as torch's; under the interpreter (whose fp8 cast rounds ties away) the kernels
round by bits first (``quantize_e4m3``), so both give torch's values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import NATIVE_CASTS
from actors.engine.model.quantization.fp8_math import (  # noqa: F401  (the oracles, here too)
    FP8_DTYPE,
    FP8_MAX,
    SCALE_FLOOR,
    dequantize_rows,
    quantize_rows_torch,
)

#: rows up to this many columns are quantized from one read (held in registers)
ONE_TILE_COLUMNS = 8192


@triton.jit
def quantize_e4m3(x):
    """``x`` (float32, within +-448) rounded to the nearest e4m3 value (ties to even), as
    float32: 3 mantissa bits by bits for normals (|x| >= 2^-6), steps of 2^-9 below."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    steps = ((ax * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # |x| to 2^-9 steps
    subnormal = (steps.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(
        tl.float32, bitcast=True)  # x's sign, -0.0 included, as torch keeps it
    return tl.where(ax < 0.015625, subnormal, normal)


@triton.jit
def row_scale(amax):
    """The row's scale from its largest magnitude (float32)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)


@triton.jit
def to_e4m3(x, scale, dtype: tl.constexpr):
    """``x * (1 / scale)`` clamped and rounded, in ``dtype`` (the fp8 pointer's element type):
    one reciprocal a row, a product an element."""
    y = tl.minimum(tl.maximum(x * tl.math.div_rn(1.0, scale), -448.0), 448.0)
    return e4m3(y, dtype)


@triton.jit
def e4m3(y, dtype: tl.constexpr):
    """``y`` (float32, within +-448) in ``dtype`` (e4m3), rounded to nearest even: the GPU's
    cast, or :func:`quantize_e4m3` then an exact cast under the interpreter."""
    if NATIVE_CASTS:
        return y.to(dtype)
    else:
        return quantize_e4m3(y).to(dtype)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          ONE_TILE: tl.constexpr):
    """One program per row; a row of at most ``BLOCK`` columns is read once (``ONE_TILE``),
    a wider one twice (its amax, then its quantization)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_TILE:
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), 0))
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + cols, to_e4m3(x, scale, q_ptr.dtype.element_ty),
                 mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = row_scale(tl.max(amax, 0))
        tl.store(s_ptr + row, scale)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
            tl.store(q_ptr + row * stride_q + start + cols,
                     to_e4m3(x.to(tl.float32), scale, q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_torch`` in one kernel (one program per row of a 2-D ``x``).

    Example:
        >>> q, s = quantize_rows(torch.randn(4, 64, dtype=torch.bfloat16))  # doctest: +SKIP
        >>> q.dtype, s.shape  # doctest: +SKIP
        (torch.float8_e4m3fn, torch.Size([4, 1]))
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(max(cols, 16))
        one_tile = block <= ONE_TILE_COLUMNS
        block = block if one_tile else 4096
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0),
                                       BLOCK=block, ONE_TILE=one_tile,
                                       num_warps=4 if block <= 1024 else 8 if block <= 4096
                                       else 16)
    return q, scale
