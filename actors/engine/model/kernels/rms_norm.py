"""RMSNorm of the Llama family: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

The mean and the scaling run in float32 as in transformers' ``LlamaRMSNorm`` (and its copies in
Qwen2/Qwen3/Mistral); the normalised row is rounded to the input dtype before the weight
multiplies it, so the result differs from the torch function only where the float32 sum of
squares rounds differently (a last-bit difference before the rounding to bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import round_to


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The oracle: transformers' RMSNorm forward, step for step."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_out, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / H + eps)
    y = round_to(x * inv, x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(w * y, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_torch`` in one kernel (one program per row of the last dimension)."""
    shape, hidden = x.shape, x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, hidden, rows.stride(0), out.stride(0), float(eps),
            BLOCK=triton.next_power_of_2(hidden), num_warps=4 if hidden <= 2048 else 8)
    return out.view(shape)
