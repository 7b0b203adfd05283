"""Loading and processing ``[R, VEC]`` tiles of a row's logits (VEC contiguous tokens per
thread; per-tile statistics reduce along VEC into ``[R]`` lane accumulators), with the
prefetch of the row-pass loops.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.process import _penalized, _processed
from sampler.kernels.token_bitmask_kernel import _bitmask_lanes, _lane_bits


@triton.jit
def _load_tile(base, start, lim, R: tl.constexpr, VEC: tl.constexpr):
    """The raw logits of the ``[R, VEC]`` tile at ``start`` (in their dtype; -inf past
    ``lim``)."""
    offs = start + tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    return tl.load(base + offs, mask=offs < lim, other=float("-inf"))


@triton.jit
def _first_tiles(base, lo, lim, R: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr):
    """The tiles a row-pass loop over ``[lo, lim)`` requests before its first iteration
    (``PREFETCH`` of them; placeholders for the rest)."""
    if PREFETCH >= 1:
        pre = _load_tile(base, lo, lim, R, VEC)
    else:
        pre = tl.zeros([R, VEC], dtype=base.dtype.element_ty)
    if PREFETCH >= 2:
        pre2 = _load_tile(base, lo + R * VEC, lim, R, VEC)
    else:
        pre2 = tl.zeros([R, VEC], dtype=base.dtype.element_ty)
    return pre, pre2


@triton.jit
def _next_tile(base, start, lim, pre, pre2, R: tl.constexpr, VEC: tl.constexpr,
               PREFETCH: tl.constexpr):
    """(this tile's raw logits, the next ``pre``, ``pre2``). With PREFETCH = d > 0 the tile
    was requested d iterations ahead and the one d tiles on is requested now, so loads are in
    flight while a tile is processed (a row pass has block-wide reductions per tile, which
    would otherwise leave one load's latency exposed per iteration)."""
    if PREFETCH >= 2:
        return pre, pre2, _load_tile(base, start + 2 * R * VEC, lim, R, VEC)
    elif PREFETCH == 1:
        return pre, _load_tile(base, start + R * VEC, lim, R, VEC), pre2
    else:
        return _load_tile(base, start, lim, R, VEC), pre, pre2


@triton.jit
def _tile_of(
    loaded, start, row, slot, V, W, lim,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
):
    """One ``[R, VEC]`` tile of ``[start, lim)`` from its loaded raw logits: (offsets, mask,
    raw fp32, processed fp32 before T). ``V`` is the vocab size (the row stride of the
    per-slot tables). ``loaded`` holds -inf past ``lim`` (:func:`_load_tile`), so unprocessed
    values need no mask of their own."""
    offs = start + tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    raw = loaded.to(tl.float32)
    vmask, x = _processed_lanes(
        raw, start + tl.arange(0, R) * VEC, offs, lim, row, slot, V, W, pbits_ptr, pmask_ptr,
        counts_ptr, rep, freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr,
        NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
    return offs, vmask, raw, x


@triton.jit
def _processed_lanes(
    raw, first, offs, lim, row, slot, V, W,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
):
    """(mask ``offs < lim``, processed values, -inf past ``lim``) of the raw fp32 logits of
    an ``[R, VEC]`` tile (-inf past ``lim`` already) whose lane ``r`` holds the tokens from
    ``first[r]`` (a multiple of VEC). The packed bits of the grammar mask (step 2, first) and
    of the penalties' touched tokens (step 6, last) are read a word a lane
    (:func:`_lane_bits`); the steps between by :func:`_processed`."""
    vmask = offs < lim
    x = raw
    if HAS_GRAMMAR:
        x = _bitmask_lanes(x, first, lim, gbits_ptr, mrow, GW, VEC)
    x = _processed(
        x, offs, vmask, row, slot, V, W,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        False, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, False,
    )
    if HAS_PEN:
        if row_pen:
            touched = _lane_bits(pbits_ptr + slot * W, first, lim, VEC) & vmask
            x = _penalized(x, offs, touched, slot, V, pmask_ptr, counts_ptr, rep, freq, pres)
    if HAS_PEN | HAS_BIAS | HAS_STOP | HAS_BAN | HAS_ALLOWED | HAS_GRAMMAR:
        x = tl.where(vmask, x, float("-inf"))
    return vmask, x
