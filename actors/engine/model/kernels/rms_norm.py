"""RMSNorm of the Llama family: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, and its
FP8 variant (``rms_norm_fp8``: the same output plus its per-token e4m3 quantization, from the
same kernel, for the FP8 projections that read it).

The mean and the scaling run in float32 as in transformers' ``LlamaRMSNorm`` (and its copies in
Qwen2/Qwen3/Mistral); the normalised row is rounded to the input dtype before the weight
multiplies it, so the result differs from the torch function only where the float32 sum of
squares rounds differently (a last-bit difference before the rounding to bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.fp8_quant import (
    FP8_DTYPE,
    quantize_rows_torch,
    row_scale,
    to_e4m3,
)
from actors.engine.model.kernels.rounding import round_to


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The oracle: transformers' RMSNorm forward, step for step."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_fp8_torch(x: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 oracle: ``(out, q, scale)``, ``out`` as ``rms_norm_torch`` and ``(q, scale)``
    its per-token quantization (``quantize_rows_torch`` of the rows of ``out``)."""
    out = rms_norm_torch(x, weight, eps)
    return (out, *quantize_rows_torch(out.reshape(-1, out.shape[-1])))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, R, H, stride_x, stride_out, stride_q,
                     eps, ROWS: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < R) & (cols < H)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 1) / H + eps)  # [ROWS]
    y = round_to(x * inv[:, None], x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    value = round_to(w * y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * stride_out + cols, value.to(out_ptr.dtype.element_ty), mask=mask)
    if QUANT:
        scale = row_scale(tl.max(tl.abs(value), 1))  # [ROWS]
        tl.store(s_ptr + rows, scale[:, None], mask=rows < R)
        tl.store(q_ptr + rows * stride_q + cols,
                 to_e4m3(value, scale[:, None], q_ptr.dtype.element_ty), mask=mask)


def rows_per_program(hidden: int) -> int:
    """Rows a program normalises: one for rows of 1,024 or more elements; narrower rows (the
    per-head q/k norms of Qwen3, 128 wide) share a program's ~2,048-element tile, so that a
    program is not one element a thread."""
    block = triton.next_power_of_2(hidden)
    return 1 if block >= 1024 else 2048 // block


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool):
    shape, hidden = x.shape, x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    q = scale = None
    if quant:
        q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        per = rows_per_program(hidden)
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], per),)](  # without QUANT, q / scale
            rows, weight, out, out if q is None else q,        # are never touched
            out if scale is None else scale, rows.shape[0], hidden, rows.stride(0),
            out.stride(0), hidden, float(eps), ROWS=per, BLOCK=triton.next_power_of_2(hidden),
            QUANT=quant, num_warps=4 if hidden <= 2048 else 8)
    return out.view(shape), q, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_torch`` in one kernel (a program per row of the last dimension, or per
    :func:`rows_per_program` rows of a narrow one)."""
    return _launch(x, weight, eps, False)[0]


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm_fp8_torch`` in one kernel: ``out`` shaped as ``x``, ``q`` ``[T, H]`` e4m3
    and ``scale`` ``[T, 1]`` float32 over the ``T`` rows of the last dimension."""
    return _launch(x, weight, eps, True)
