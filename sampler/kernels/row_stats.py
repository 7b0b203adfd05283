"""Pass 1 of the fused kernel, the row statistics: greedy (value, index), max of x / T, the
raw and temperature log-sum-exps, and for a random row without min-p its first draw. Also as
a kernel over vocab chunks (the greedy split) whose partials the fused kernel combines.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.draw import _draw_tile_lazy
from sampler.kernels.process import _row_processing
from sampler.kernels.reductions import _best, _lse_pair, _online_lse
from sampler.kernels.tiles import _first_tiles, _next_tile, _processed_lanes, _tile_of
from sampler.kernels.token_bitmask_kernel import _mask_row


@triton.jit
def _stats_range(
    base, lo, hi, row, slot, V, W, T, greedy, lp_on, mode,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ANY_LP: tl.constexpr, ANY_RANDOM: tl.constexpr,
    DRAW1: tl.constexpr = False, draw1=False, k0=0, k1=0, PREFETCH: tl.constexpr = 1,
):
    """Pass 1 over ``[lo, hi)``: per-lane greedy (value, index), max of x / T, and online
    log-sum-exp accumulators of the raw values and of raw / T. With ``draw1`` (a random row
    without min-p) also the per-lane accumulators of the Gumbel-max draw over every finite
    x / T (:func:`_draw_tile`), the draw the fused kernel would otherwise make in a pass of
    its own."""
    NEG = float("-inf")
    acc_bv = tl.full([R], NEG, tl.float32)
    acc_bs = tl.zeros([R], dtype=tl.int32) + lo  # start of the tile holding the lane's best
    acc_ms = tl.full([R], NEG, tl.float32)
    acc_mr = tl.full([R], NEG, tl.float32)
    acc_lr = tl.zeros([R], dtype=tl.float32)
    acc_mt = tl.full([R], NEG, tl.float32)
    acc_lt = tl.zeros([R], dtype=tl.float32)
    d_sv = tl.full([R], NEG, tl.float32)
    d_si = tl.zeros([R], dtype=tl.int32)
    d_ss = tl.full([R], NEG, tl.float32)
    d_best = NEG
    # all-greedy launches without logprobs keep each lane's best tile as loaded (no second
    # read of it; with the log-sum-exp loop the extra registers cost a block per SM)
    KEEP: tl.constexpr = (not ANY_RANDOM) and (not ANY_LP)
    best_tile = tl.full([R, VEC], NEG, base.dtype.element_ty)
    inv_t = 1.0 / T
    pre, pre2 = _first_tiles(base, lo, hi, R, VEC, PREFETCH)
    for start in tl.range(lo, hi, R * VEC, num_stages=1):  # not software-pipelined
        cur, pre, pre2 = _next_tile(base, start, hi, pre, pre2, R, VEC, PREFETCH)
        offs, vmask, raw, x = _tile_of(
            cur, start, row, slot, V, W, hi, pbits_ptr, pmask_ptr, counts_ptr, rep, freq,
            pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP,
            min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
        if greedy | (not ANY_RANDOM):  # the index is found after the loop
            tv = tl.max(x, 1)
            upd = tv > acc_bv
            acc_bv = tl.where(upd, tv, acc_bv)
            acc_bs = tl.where(upd, start, acc_bs)
            if KEEP:
                best_tile = tl.where(upd[:, None], cur, best_tile)
        else:  # divided by T after the loop (rounded division by T > 0 keeps the order)
            acc_ms = tl.maximum(acc_ms, tl.max(x, 1))
            if DRAW1:
                if draw1:
                    d_sv, d_si, d_ss, d_best = _draw_tile_lazy(
                        x, T, inv_t, NEG, NEG, offs, k0, k1, d_sv, d_si, d_ss, d_best)
        if ANY_LP:
            if lp_on:
                acc_mr, acc_lr = _online_lse(raw, acc_mr, acc_lr)
                if mode == 4:
                    acc_mt, acc_lt = _online_lse(tl.math.div_rn(raw, T), acc_mt, acc_lt)
    if greedy | (not ANY_RANDOM):
        acc_bi = _lane_argmax(
            base, best_tile, acc_bs, acc_bv, hi, row, slot, V, W, pbits_ptr, pmask_ptr, counts_ptr,
            rep, freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP,
            min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR, KEPT=KEEP)
    else:
        acc_bi = acc_bs
        acc_ms = tl.math.div_rn(acc_ms, T)
    return acc_bv, acc_bi, acc_ms, acc_mr, acc_lr, acc_mt, acc_lt, d_sv, d_si, d_ss


@triton.jit
def _lane_argmax(
    base, kept, tile_start, best, lim, row, slot, V, W,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    KEPT: tl.constexpr,
):
    """Each lane's greedy index: the lowest one of the lane's ``VEC`` tokens in the tile at
    ``tile_start`` whose processed value equals ``best`` (the first tile where the lane's
    maximum was reached; its tokens are processed again, to the same values: ``kept`` holds
    their raw logits when KEPT, else they are read again). A pass keeps only the tile (or its
    start) per tile, so the per-token arithmetic of an argmax stays out of its loop."""
    lane = tl.arange(0, R)
    col = tl.arange(0, VEC)
    offs = tile_start[:, None] + lane[:, None] * VEC + col[None, :]
    if KEPT:
        raw = kept.to(tl.float32)
    else:
        raw = tl.load(base + offs, mask=offs < lim, other=float("-inf")).to(tl.float32)
    _m, x = _processed_lanes(
        raw, tile_start + lane * VEC, offs, lim, row, slot, V, W, pbits_ptr, pmask_ptr,
        counts_ptr, rep, freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr,
        NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
    j = tl.min(tl.where(x == best[:, None], col[None, :], VEC - 1), 1)
    return tile_start + lane * VEC + j


@triton.jit
def _stats_kernel(
    logits_ptr, stride_row, V, W,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr,
    pbits_ptr, pmask_ptr, counts_ptr, bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP, ban_ptr, NBAN, allowed_ptr, gbits_ptr, grow_ptr, GW,
    part_ptr, part_i_ptr, NCHUNK, CHUNK,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr, ANY_LP: tl.constexpr,
    ANY_RANDOM: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
    PREFETCH: tl.constexpr = 1,
):
    """Pass 1 of the fused kernel split over vocab chunks (grid rows x chunks), so short
    batches still spread the first read of the logits over the whole GPU. Writes per-chunk
    partials ``[rows, chunks, 8]``: greedy value, max of x / T, (max, sum) of the two
    log-sum-exps; and the greedy index (``part_i``), combined by :func:`_chunk_stats`."""
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(idx_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    T, rep, freq, pres, row_pen, min_tok_active, row_allowed = _row_processing(
        fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr, slot)
    mrow = _mask_row(grow_ptr, row, HAS_GRAMMAR)
    nlp = tl.load(iparams_ptr + slot * stride_i + 4)
    mode = tl.load(iparams_ptr + slot * stride_i + 5)
    greedy = tl.load(iparams_ptr + slot * stride_i + 6) != 0
    raw_family = (mode == 0) | (mode == 1) | (mode == 4)
    lp_on = (nlp != -2) & raw_family & (nlp >= 0)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    acc_bv, acc_bi, acc_ms, acc_mr, acc_lr, acc_mt, acc_lt, _dv, _di, _ds = _stats_range(
        base, lo, hi, row, slot, V, W, T, greedy, lp_on, mode,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR, ANY_LP, ANY_RANDOM,
        PREFETCH=PREFETCH)
    bv, bi = _best(acc_bv, acc_bi)
    mr, lr = _lse_pair(acc_mr, acc_lr)
    mt, lt = _lse_pair(acc_mt, acc_lt)
    out = part_ptr + (row * NCHUNK + c) * 8
    tl.store(out + 0, bv)
    tl.store(out + 1, tl.max(acc_ms, 0))
    tl.store(out + 2, mr)
    tl.store(out + 3, lr)
    tl.store(out + 4, mt)
    tl.store(out + 5, lt)
    tl.store(part_i_ptr + row * NCHUNK + c, tl.where(bv > float("-inf"), bi, lo))


@triton.jit
def _chunk_stats(part_ptr, part_i_ptr, row, NCHUNK, NCP2: tl.constexpr):
    """The partials of :func:`_stats_kernel` for a row, as lane accumulators (one lane a
    chunk): (greedy value, index, max of x / T, raw lse pair, temperature lse pair)."""
    NEG = float("-inf")
    jc = tl.arange(0, NCP2)
    pf = part_ptr + (row * NCHUNK + jc) * 8
    live = jc < NCHUNK
    acc_bv = tl.load(pf + 0, mask=live, other=NEG)
    acc_bi = tl.load(part_i_ptr + row * NCHUNK + jc, mask=live, other=0)
    acc_ms = tl.load(pf + 1, mask=live, other=NEG)
    acc_mr = tl.load(pf + 2, mask=live, other=NEG)
    acc_lr = tl.load(pf + 3, mask=live, other=0.0)
    acc_mt = tl.load(pf + 4, mask=live, other=NEG)
    acc_lt = tl.load(pf + 5, mask=live, other=0.0)
    return acc_bv, acc_bi, acc_ms, acc_mr, acc_lr, acc_mt, acc_lt
