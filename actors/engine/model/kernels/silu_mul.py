"""The gated-SiLU product of Llama-family MLPs: ``silu(gate) * up``, rounded to the input dtype
after the SiLU and after the product as the two torch ops do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import round_to


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The oracle: ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn`` SiLU."""
    return torch.nn.functional.silu(gate) * up


@triton.jit(do_not_specialize=["N"])  # the token count must not make new variants
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = round_to(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out_ptr + offs, round_to(s * u, dt).to(dt), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_torch`` in one elementwise kernel (same-shape, same-dtype inputs)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return silu_mul_torch(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = 2048
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=8)
    return out
