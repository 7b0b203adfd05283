"""Rotary position embedding of the Llama family (``rotate_half`` convention): for each head
``x``, ``x * cos + rotate_half(x) * sin`` for the query and key heads of a packed step in one
kernel (one program per token).

Each product and the sum are rounded to the tensors' dtype as the torch ops do (a product of
two bf16/fp16 values is exact in float32), so in bf16 and fp16 the result is bit-identical to
transformers' ``apply_rotary_pos_emb``; launch with ``enable_fp_fusion=False`` so float32 inputs
round alike too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import round_to


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: ``q``/``k`` ``[1, heads, T, D]``, ``cos``/``sin`` ``[1, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, NH, s_h, s_t, so_h, so_t, c1, c2, s1, s2,
                  HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    heads = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    mask = (heads < NH) & (d < HALF)
    src = x_ptr + t * s_t + heads * s_h + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    lo = round_to(round_to(x1 * c1, dt) + round_to(-x2 * s1, dt), dt).to(dt)
    hi = round_to(round_to(x2 * c2, dt) + round_to(x1 * s2, dt), dt).to(dt)
    dst = o_ptr + t * so_t + heads * so_h + d
    tl.store(dst, lo, mask=mask)
    tl.store(dst + HALF, hi, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                   HQ, HK, sq_h, sq_t, sk_h, sk_t, sc_t, ss_t, sqo_h, sqo_t, sko_h, sko_t,
                   HALF: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr,
                   BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)[None, :]
    dm = d < HALF
    c1 = tl.load(cos_ptr + t * sc_t + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * sc_t + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * ss_t + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * ss_t + HALF + d, mask=dm, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, t, HQ, sq_h, sq_t, sqo_h, sqo_t, c1, c2, s1, s2,
                  HALF, BHQ, BD)
    _rotate_heads(k_ptr, ko_ptr, t, HK, sk_h, sk_t, sko_h, sko_t, c1, c2, s1, s2,
                  HALF, BHK, BD)


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes (anything else goes to the torch function)."""
    return (q.dim() == 4 and k.dim() == 4 and q.shape[0] == 1 and k.shape[0] == 1
            and q.shape[2:] == k.shape[2:] and cos.shape == sin.shape
            and cos.dim() == 3 and cos.shape[0] == 1 and cos.shape[1:] == q.shape[2:]
            and q.shape[-1] % 2 == 0 and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_torch`` in one kernel; the outputs keep the inputs' memory layout."""
    if not supported(q, k, cos, sin):
        return apply_rotary_torch(q, k, cos, sin)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    tokens, dim = q.shape[2], q.shape[3]
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, cos, sin, qo, ko, q.shape[1], k.shape[1],
            q.stride(1), q.stride(2), k.stride(1), k.stride(2), cos.stride(1), sin.stride(1),
            qo.stride(1), qo.stride(2), ko.stride(1), ko.stride(2),
            HALF=dim // 2, BHQ=triton.next_power_of_2(q.shape[1]),
            BHK=triton.next_power_of_2(k.shape[1]), BD=triton.next_power_of_2(dim // 2),
            num_warps=4, enable_fp_fusion=False)
    return qo, ko
