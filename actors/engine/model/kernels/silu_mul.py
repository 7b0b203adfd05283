"""The gated-SiLU product of Llama-family MLPs: ``silu(gate) * up``, rounded to the input dtype
after the SiLU and after the product as the two torch ops do; ``silu_mul_fp8`` quantizes the
(rounded) product per token to e4m3 for an FP8 ``down_proj``: a row of up to
``ONE_PASS_COLUMNS`` is read once and held in registers by one program; a wider row takes two
kernels over blocks of columns (each block's amax; then each block quantized with its row's
scale)."""

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

#: rows up to this many columns are quantized by one program from one read (the fastest at 512
#: to 16,384 rows of 14,336 columns on an H200: docs/fp8.md); wider rows take two kernels
ONE_PASS_COLUMNS = 16384


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The oracle: ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn`` SiLU."""
    return torch.nn.functional.silu(gate) * up


def silu_mul_fp8_torch(gate: torch.Tensor, up: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 oracle: ``quantize_rows_torch(silu_mul_torch(gate, up))`` of ``[T, I]`` inputs."""
    return quantize_rows_torch(silu_mul_torch(gate, up))


@triton.jit
def _silu_product(gate_ptr, up_ptr, offs, mask, dt: tl.constexpr):
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = round_to(g / (1.0 + tl.exp(-g)), dt)
    return round_to(s * u, dt)


@triton.jit
def _silu_quant_row_kernel(gate_ptr, up_ptr, q_ptr, s_ptr, I, gate_row, up_row,
                           BLOCK: tl.constexpr):
    """One program a row (``BLOCK >= I``): the product, its amax and its quantization."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    value = _silu_product(gate_ptr + row * gate_row, up_ptr + row * up_row, cols, mask,
                          gate_ptr.dtype.element_ty)
    scale = row_scale(tl.max(tl.abs(value), 0))
    tl.store(s_ptr + row, scale)
    tl.store(q_ptr + row * I + cols, to_e4m3(value, scale, q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_amax_kernel(gate_ptr, up_ptr, part_ptr, I, gate_row, up_row, BLOCK: tl.constexpr,
                      NBLK: tl.constexpr):
    """Programs ``(row, block of I)``: the block's largest |product|."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    value = _silu_product(gate_ptr + row * gate_row, up_ptr + row * up_row, cols, cols < I,
                          gate_ptr.dtype.element_ty)
    tl.store(part_ptr + row * NBLK + tl.program_id(1), tl.max(tl.abs(value), 0))


@triton.jit
def _silu_quant_kernel(gate_ptr, up_ptr, part_ptr, q_ptr, s_ptr, I, gate_row, up_row,
                       BLOCK: tl.constexpr, NBLK: tl.constexpr):
    """Programs ``(row, block of I)``: the row's scale from its blocks' amax, the block's
    product (the same arithmetic again, so the same values) quantized with it."""
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, NBLK)
    amax = tl.load(part_ptr + row * NBLK + blocks, mask=blocks < tl.num_programs(1), other=0.0)
    scale = row_scale(tl.max(amax, 0))
    if tl.program_id(1) == 0:
        tl.store(s_ptr + row, scale)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    value = _silu_product(gate_ptr + row * gate_row, up_ptr + row * up_row, cols, mask,
                          gate_ptr.dtype.element_ty)
    tl.store(q_ptr + row * I + cols, to_e4m3(value, scale, q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, I, gate_row, up_row, BLOCK: tl.constexpr):
    """Programs ``(row, block of I)``: the token count is the grid, never an argument."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gate_ptr + row * gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = round_to(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out_ptr + row * I + cols, round_to(s * u, dt).to(dt), mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_torch`` in one elementwise kernel (same-shape, same-dtype inputs). Rows may
    be strided (the two column halves of one gate/up GEMM's output are read in place)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return silu_mul_torch(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    width = gate.shape[-1] if gate.dim() else 1
    if out.numel():
        g, u = _rows(gate, width), _rows(up, width)
        block = min(triton.next_power_of_2(width), 2048)
        _silu_mul_kernel[(g.shape[0], triton.cdiv(width, block))](
            g, u, out, width, g.stride(0), u.stride(0), BLOCK=block,
            num_warps=4 if block <= 1024 else 8)
    return out


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul_fp8_torch`` in one kernel (two for rows over ``ONE_PASS_COLUMNS``):
    ``gate``/``up`` ``[T, I]`` (same dtype; rows may be strided, as the two column halves of
    one gate/up GEMM's output) -> ``q`` ``[T, I]`` e4m3, ``scale`` ``[T, 1]`` float32; the
    bf16 product is never stored."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate, up: expected two [T, I] tensors of one dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    rows, cols = gate.shape
    gate, up = _rows(gate, cols), _rows(up, cols)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=gate.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate.device)
    if rows and triton.next_power_of_2(cols) <= ONE_PASS_COLUMNS:
        block = triton.next_power_of_2(max(cols, 16))
        _silu_quant_row_kernel[(rows,)](gate, up, q, scale, cols, gate.stride(0), up.stride(0),
                                        BLOCK=block, num_warps=max(4, min(16, block // 1024)))
    elif rows:
        block = 2048
        blocks = triton.cdiv(cols, block)
        nblk = triton.next_power_of_2(blocks)
        part = torch.empty((rows, nblk), dtype=torch.float32, device=gate.device)
        args = (cols, gate.stride(0), up.stride(0))
        _silu_amax_kernel[(rows, blocks)](gate, up, part, *args, BLOCK=block, NBLK=nblk,
                                          num_warps=8)
        _silu_quant_kernel[(rows, blocks)](gate, up, part, q, scale, *args, BLOCK=block,
                                           NBLK=nblk, num_warps=8)
    return q, scale
