"""Counter-based Gumbel noise in Triton: the bits and the float math of
:mod:`sampler.ops.gumbel` (the hash: docs/sampler_kernels.md), 32-bit noise.

``-log1p(-y)`` is computed as ``-log(u) * y / (1 - u)`` with ``u = 1 - y`` (exact to a few ulp
and identical under the interpreter and on the GPU), so the noise can differ from torch's
``log1p`` in the last bits; the hash bits are identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LANE0: tl.constexpr = tl.constexpr(0x243F6A88)
LANE1: tl.constexpr = tl.constexpr(0x85A308D3)


@triton.jit
def _r1(x):
    return (x ^ (x >> 16)) * 0x21F0AAAD


@triton.jit
def _r2(x):
    y = (x ^ (x >> 15)) * 0x735A2D97
    return y ^ (y >> 15)


@triton.jit
def _mix(x):
    return _r2(_r1(x))


@triton.jit
def _row_key(seed, sidx, pos, lane_const):
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    si = (sidx & 0xFFFFFFFF).to(tl.uint32)
    p = (pos & 0xFFFFFFFF).to(tl.uint32)
    a = _mix(lo ^ lane_const)
    a = _mix(a ^ hi)
    a = _mix(a ^ si)
    return _mix(a ^ p)


@triton.jit
def _gumbel_bits(ids, k0, k1):
    """The 32 hash bits of token ids (int32 tensor) for one row's keys (uint32 scalars); the
    noise is non-decreasing in them (as unsigned integers)."""
    return _r2(_r1(ids.to(tl.uint32) + k0) ^ k1)


@triton.jit
def _gumbel_of_bits(b):
    """Gumbel noise of hash bits ``b`` (uint32): ``-log(E)`` with ``E = -log(u)``,
    ``u = (2b + 1) / 2**33``; for the upper half of ``b``, ``-log1p(-y)`` with
    ``y = (2c + 1) / 2**33`` and ``c = 2**32 - 1 - b`` (exact in 32 bits), in the form of the
    module docstring. One logarithm serves both halves."""
    low = b < 2147483648
    c = tl.where(low, b, 4294967295 - b)
    v = (2 * c + 1).to(tl.float32) * 1.1641532182693481e-10
    u = 1.0 - v
    lg = -tl.log(tl.where(low, v, u))
    e = tl.where(low, lg, tl.where(u == 1.0, v, lg * (v / (1.0 - u))))
    return -tl.log(e)


@triton.jit
def _gumbel_upper(b):
    """A cheap upper bound on :func:`_gumbel_of_bits` (no logarithm): below half of the bits
    the noise is at most ``-log(log 2) = 0.36651...``; above, ``E = -log1p(-y) >= y``, so the
    noise is at most ``-log(y) = -ln 2 * log2(y)``, and ``log2(y) >= e + (m - 1)`` for
    ``y = m * 2**e`` (``log2`` is concave on ``[1, 2]``), which puts the bound at most 0.06
    above ``-log(y)``.
    Callers add slack for the rounding of both sides."""
    low = b < 2147483648
    c = tl.where(low, b, 4294967295 - b)
    y = (2 * c + 1).to(tl.float32) * 1.1641532182693481e-10
    yb = y.to(tl.int32, bitcast=True)
    e = ((yb >> 23) - 127).to(tl.float32)
    m = ((yb & 8388607) | 1065353216).to(tl.float32, bitcast=True)
    return tl.where(low, 0.36652, -0.6931472 * (e + (m - 1.0)))


@triton.jit
def _gumbel(ids, k0, k1):
    """Gumbel noise of token ids (int32 tensor) for one row's keys (uint32 scalars)."""
    return _gumbel_of_bits(_gumbel_bits(ids, k0, k1))


@triton.jit
def _noise_kernel(seed_ptr, pos_ptr, sidx_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    sidx = tl.load(sidx_ptr + row)
    k0 = _row_key(seed, sidx, pos, tl.full((), LANE0, tl.uint32))
    k1 = _row_key(seed, sidx, pos, tl.full((), LANE1, tl.uint32))
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row.to(tl.int64) * V + offs, _gumbel(offs, k0, k1), mask=offs < V)


def compute_gumbel_noise(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    sample_indices: torch.Tensor,
    vocab_size: int,
    precision: str = "fp32",
) -> torch.Tensor:
    """Triton twin of :func:`sampler.ops.gumbel.compute_gumbel_noise` (fp32 noise only).

    Args:
        seeds, positions, sample_indices: ``[rows]`` int64.
        vocab_size: tokens per row.
        precision: must be "fp32".

    Returns:
        ``[rows, vocab_size]`` float32 Gumbel noise.
    """
    if precision != "fp32":
        raise ValueError(f"precision: the Triton noise is fp32 only, got {precision!r}")
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=seeds.device)
    if rows:
        _noise_kernel[(rows,)](seeds.to(torch.int64).contiguous(),
                               positions.to(torch.int64).contiguous(),
                               sample_indices.to(torch.int64).contiguous(), out, vocab_size,
                               BLOCK=min(4096, triton.next_power_of_2(vocab_size)),
                               enable_fp_fusion=False)
    return out


@triton.jit
def _noise_of_bits_kernel(bits_ptr, out_ptr, N, BLOCK: tl.constexpr, UPPER: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    b = tl.load(bits_ptr + offs, mask=m, other=0).to(tl.uint32)
    if UPPER:
        tl.store(out_ptr + offs, _gumbel_upper(b), mask=m)
    else:
        tl.store(out_ptr + offs, _gumbel_of_bits(b), mask=m)


def noise_of_bits(bits: torch.Tensor, *, upper: bool = False) -> torch.Tensor:
    """Triton twin of :func:`sampler.ops.gumbel.gumbel_from_bits` (fp32): the noise of given
    32-bit hash values; with ``upper``, the cheap bound on it that the sampling passes skip
    tiles by (:func:`_gumbel_upper`).

    Args:
        bits: int64 tensor of values in ``[0, 2**32)``.
        upper: return the bound instead of the noise.

    Returns:
        float32 tensor of the shape of ``bits``.
    """
    flat = bits.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32, device=bits.device)
    if flat.numel():
        _noise_of_bits_kernel[(triton.cdiv(flat.numel(), 1024),)](
            flat, out, flat.numel(), BLOCK=1024, UPPER=upper, enable_fp_fusion=False)
    return out.reshape(bits.shape)
