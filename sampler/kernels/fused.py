"""The fused sampling kernel: steps 2–12 and the raw-family logprobs of a batch, one program
per row, without a ``[rows, vocab]`` float32 tensor.

Tiles are 2-D ``[R, VEC]`` (VEC contiguous tokens per thread): per-tile statistics reduce
along VEC inside a thread into ``[R]`` lane accumulators, and lanes are combined once per
pass, so a pass has no per-tile barrier. Candidate lists are appended with atomics and read
back after a barrier.

Passes over a row (each reads the row's bf16/fp16/fp32 logits; later passes mostly hit L2):

1. statistics: processed values (steps 2–6), greedy argmax (ties to the lowest id), the
   maximum after temperature, raw max / log-sum-exp (raw_logprobs), log-sum-exp of raw / T
   (temperature_logprobs); for a random row without min-p also its first Gumbel-max draw
   (the only one when it has no top-k / top-p);
2. selection (only rows with top-k / top-p, and rows asking for top-k logprobs): histogram
   passes narrowing the boundary bin, then a gather pass into a scratch list of at most
   ``CAP`` candidates, sorted exactly; top-k takes the k-th value, top-p the tie-extended
   prefix whose strictly-greater mass is ``< p`` of the mass kept by top-k (SAMPLER_SPEC §2);
3. the draw: Gumbel-max over the kept candidates when they were all gathered, else pass 1's
   draw when every finite value is kept, else one pass over the row; a draw pass computes the
   noise's logarithms only for tiles that could hold the winner (:func:`_draw_tile`); greedy
   rows already have their token;
4. logprobs: the sampled token's value in its mode, its rank (from the candidate list or a
   counting pass), the top-k list from the raw candidates.

Processed logprobs modes and whole-vocab (-1) logprobs are not computed here (the launcher
uses the torch path for such batches). With ``HAS_DONE`` a row whose flag is set (settled by
the chunked pipeline, :mod:`sampler.kernels.chunked`, or the candidate path,
:mod:`sampler.kernels.candidates`) is skipped; pass 1 comes from the chunked pipeline's chunk
statistics (``SPLIT``) or is the kernel's own. With ``RECORD`` each row it samples also
advances its slot (:func:`sampler.kernels.record._record_row`), so the step needs no record
launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.token_bitmask import _mask_row

from sampler.kernels.noise import (LANE0, LANE1, _gumbel, _gumbel_bits, _gumbel_of_bits,
                                   _gumbel_upper, _row_key)
from sampler.kernels.process import _processed, _row_processing
from sampler.kernels.record import _record_row
from sampler.kernels.select import _bin_of, _choose_bin, _key_id, _key_value, _order_key


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
    vmask, x = _processed_at(
        raw, offs, lim, row, slot, V, W, pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres,
        row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
    return offs, vmask, raw, x


@triton.jit
def _processed_at(
    raw, offs, lim, row, slot, V, W,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
):
    """(mask ``offs < lim``, processed values, -inf past ``lim``) of raw fp32 logits at
    ``offs`` that already hold -inf past ``lim``."""
    vmask = offs < lim
    x = _processed(
        raw, offs, vmask, row, slot, V, W,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
    )
    if HAS_PEN | HAS_BIAS | HAS_STOP | HAS_BAN | HAS_ALLOWED | HAS_GRAMMAR:
        x = tl.where(vmask, x, float("-inf"))
    return vmask, x


@triton.jit
def _mode_value(raw, mode, T, lse_r, lse_t):
    """Values of the raw-family logprobs modes: 0 raw_logprobs, 1 raw_logits, 4 temperature."""
    return tl.where(mode == 0, raw - lse_r,
                    tl.where(mode == 4, tl.math.div_rn(raw, T) - lse_t, raw))


@triton.jit
def _token_value(base, tok, mode, T, lse_r, lse_t):
    """(raw logit, raw-family logprobs value) of token ``tok`` of the row at ``base``."""
    raw_tok = tl.load(base + tok).to(tl.float32)
    return raw_tok, _mode_value(raw_tok, mode, T, lse_r, lse_t)


@triton.jit
def _exp(x):
    """``exp(x)`` as ``2 ** (x * log2(e))`` with results below 2^-126 flushed to zero: the
    value of ``tl.exp`` (the same scaling and hardware ``ex2``) without its subnormal
    fix-up, which costs three more instructions a token on the GPU."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _online_lse(v, m, acc):
    """One tile into per-lane online log-sum-exp accumulators (m, acc) of shape [R]."""
    nm = tl.maximum(m, tl.max(v, 1))
    live = nm > float("-inf")
    safe = tl.where(live, nm, 0.0)
    acc = tl.where(live, acc * _exp(m - safe) + tl.sum(_exp(v - safe[:, None]), 1), acc)
    return nm, acc


@triton.jit
def _lse_pair(m, acc):
    """Combines per-lane (m, acc) into one (max, sum of exp(x - max))."""
    mm = tl.max(m, 0)
    return mm, tl.sum(tl.where(m > float("-inf"), acc * tl.exp(m - mm), 0.0), 0)


@triton.jit
def _lse(m, acc):
    """Combines per-lane (m, acc) into log-sum-exp."""
    mm, total = _lse_pair(m, acc)
    return mm + tl.log(total)


@triton.jit
def _stats_range(
    base, lo, hi, row, slot, V, W, T, greedy, lp_on, mode,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ANY_LP: tl.constexpr, ANY_RANDOM: tl.constexpr, STAGES: tl.constexpr = 1,
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
    for start in tl.range(lo, hi, R * VEC, num_stages=STAGES):
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
    _m, x = _processed_at(
        raw, offs, lim, row, slot, V, W, pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres,
        row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
    j = tl.min(tl.where(x == best[:, None], col[None, :], VEC - 1), 1)
    return tile_start + lane * VEC + j


@triton.jit
def _next_up(x):
    """The next float32 above ``x`` (``x >= 0``)."""
    return (x.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _next_width(lo, hi, w, NP: tl.constexpr):
    """Bin width of the next refinement pass over ``[lo, hi)``: the open last bin widens, a
    closed range splits into NP - 1 bins, never narrower than one float step (so no two
    edges coincide)."""
    return tl.where(hi == float("inf"), w * (NP - 1),
                    tl.maximum((hi - lo) / (NP - 1), _next_up(lo) - lo))


@triton.jit
def _kth_largest(lanes, k):
    """The k-th largest of a row's per-lane maxima (-inf when there are fewer than k lanes):
    k distinct tokens are >= it, so it bounds the row's k-th largest value from below."""
    ordered = tl.sort(lanes, 0, descending=True)
    jj = tl.arange(0, lanes.shape[0])
    return tl.max(tl.where(jj == k - 1, ordered, float("-inf")), 0)


@triton.jit
def _best(acc_v, acc_i):
    """Lane (value, index) accumulators -> the maximum and its lowest index (0 if none)."""
    best = tl.max(acc_v, 0)
    idx = tl.min(tl.where(acc_v == best, acc_i, 2147483647), 0)
    return best, tl.where(best > float("-inf"), idx, 0)


@triton.jit
def _count_bins(b, jj, NP: tl.constexpr, HIST: tl.constexpr, R: tl.constexpr,
                VEC: tl.constexpr):
    """Per-tile bin counts ``[NP]`` of the int bins ``b`` ([R, VEC])."""
    if HIST:
        return tl.histogram(tl.reshape(b, [R * VEC]), NP)
    else:
        acc = tl.zeros([R, NP], dtype=tl.int32)
        for j in tl.static_range(NP - 1):
            acc += tl.where(jj[None, :] == j, tl.sum((b == j).to(tl.int32), 1)[:, None], 0)
        return tl.sum(acc, 0)


@triton.jit
def _mass_bins(b, e, jj, NP: tl.constexpr, R: tl.constexpr):
    acc = tl.zeros([R, NP], dtype=tl.float32)
    for j in tl.static_range(NP - 1):
        acc += tl.where(jj[None, :] == j, tl.sum(tl.where(b == j, e, 0.0), 1)[:, None], 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _append(cand, counter, sel, keys, CAP: tl.constexpr):
    """Appends ``keys[sel]`` to a candidate list through an atomic counter (any order)."""
    pos = tl.atomic_add(counter + tl.zeros_like(keys).to(tl.int32), 1, mask=sel)
    tl.store(cand + pos, keys, mask=sel & (pos < CAP))


@triton.jit
def _read_cands(cand, n, CAP: tl.constexpr):
    jj = tl.arange(0, CAP)
    return tl.load(cand + jj, mask=jj < n, other=-9223372036854775807 - 1, cache_modifier=".cg")


@triton.jit
def _top_p_within(vals, keep, m_s, top_p):
    """The top-p boundary value over the kept candidates ``vals[keep]`` (sorted descending,
    ``keep`` a prefix): the last value of the tie-extended prefix whose strictly-greater mass
    is ``< p`` of the kept mass (SAMPLER_SPEC section 2)."""
    ii = tl.arange(0, vals.shape[0])
    e = tl.where(keep, _exp(vals - m_s), 0.0)
    c = tl.cumsum(e, 0)
    nk = tl.sum(keep.to(tl.int32), 0)
    limit = top_p * tl.sum(e, 0)
    cnt = (limit > 0).to(tl.int32) + tl.sum(((ii < nk - 1) & (c < limit)).to(tl.int32), 0)
    return tl.sum(tl.where(ii == cnt - 1, vals, 0.0), 0)


@triton.jit
def _gumbel_max_of(vals, ids, kept, k0, k1):
    """The Gumbel-max token among the candidates ``kept`` (lowest id on a tie; 0 if none)."""
    score = tl.where(kept, vals + _gumbel(ids, k0, k1), float("-inf"))
    best = tl.max(score, 0)
    tok = tl.min(tl.where(kept & (score == best), ids, 2147483647), 0)
    return tl.where(best > float("-inf"), tok, 0)


@triton.jit
def _draw_update(sk, kept, bits, offs, acc_sv, acc_si, acc_ss):
    """The Gumbel-max accumulators (best score, its token, its value per lane) updated with a
    ``[R, VEC]`` tile's kept tokens (values ``sk``, hash bits ``bits``)."""
    score = tl.where(kept, sk + _gumbel_of_bits(bits), float("-inf"))
    am = tl.argmax(score, 1)
    tv = tl.max(score, 1)
    col = tl.arange(0, sk.shape[1])[None, :]
    ts = tl.sum(tl.where(col == am[:, None], sk, 0.0), 1)
    upd = tv > acc_sv
    acc_sv = tl.where(upd, tv, acc_sv)
    acc_si = tl.where(upd, tl.min(offs, 1) + am, acc_si)
    acc_ss = tl.where(upd, ts, acc_ss)
    return acc_sv, acc_si, acc_ss


@triton.jit
def _token_bound(sk, kept, bits):
    """An upper bound on the largest ``sk + noise`` over the kept tokens of a tile: each
    token's ``sk`` plus :func:`_gumbel_upper` of its own bits, with slack for the rounding of
    the noise, of the sum and of ``sk`` itself (callers may pass ``x * (1 / T)`` for
    ``x / T``). ``-inf`` when nothing is kept."""
    up = _gumbel_upper(bits)  # > 0.36
    ub = (sk + up) + ((tl.abs(sk) + up) * 1e-5 + 1e-3)
    return tl.max(tl.max(tl.where(kept, ub, float("-inf")), 1), 0)


@triton.jit
def _draw_tile(sk, kept, offs, k0, k1, acc_sv, acc_si, acc_ss, best, SKIP: tl.constexpr):
    """One ``[R, VEC]`` tile into the per-lane Gumbel-max accumulators (best score, its token,
    its value) over the tokens ``kept`` (values ``sk``); ``best`` is the best score so far
    (the accumulators' maximum, kept up to date here). With SKIP the noise's logarithms are
    computed only when the tile's bound (:func:`_token_bound`) reaches ``best`` (the hash bits
    are cheap, the logarithms are not). A skipped tile holds no score >= ``best``, so no tie
    is lost."""
    bits = _gumbel_bits(offs, k0, k1)
    go = True
    if SKIP:
        go = _token_bound(sk, kept, bits) >= best
    if go:
        acc_sv, acc_si, acc_ss = _draw_update(sk, kept, bits, offs, acc_sv, acc_si, acc_ss)
        best = tl.max(acc_sv, 0)
    return acc_sv, acc_si, acc_ss, best


@triton.jit
def _draw_tile_lazy(x, T, inv_t, thr, floor, offs, k0, k1, acc_sv, acc_si, acc_ss, best):
    """:func:`_draw_tile` (SKIP) over the tokens with ``thr <= x / T``, ``floor <
    x / T`` and ``x / T > -inf``, dividing by T only in tiles that may hold the winner: the
    bound takes ``x * (1 / T)`` (within a few ulp of the rounded quotient; the bound's slack
    covers them) over a superset of those tokens."""
    NEG = float("-inf")
    bits = _gumbel_bits(offs, k0, k1)
    xs = x * inv_t
    d = tl.abs(xs) * 1e-5 + 1e-30
    sup = (x > NEG) & (xs + d >= thr) & (xs + d > floor)
    if _token_bound(xs, sup, bits) >= best:
        s = tl.math.div_rn(x, T)
        kept = (s >= thr) & (s > NEG) & (s > floor)
        acc_sv, acc_si, acc_ss = _draw_update(tl.where(kept, s, NEG), kept, bits, offs,
                                              acc_sv, acc_si, acc_ss)
        best = tl.max(acc_sv, 0)
    return acc_sv, acc_si, acc_ss, best


@triton.jit
def _draw_result(acc_sv, acc_si, acc_ss):
    """Per-lane draw accumulators -> (token, its value, best score); the lowest token on a
    tie, (0, -inf, -inf) when nothing was kept."""
    NEG = float("-inf")
    best = tl.max(acc_sv, 0)
    tok = tl.min(tl.where(acc_sv == best, acc_si, 2147483647), 0)
    s_tok = tl.max(tl.where((acc_sv == best) & (acc_si == tok), acc_ss, NEG), 0)
    s_tok = tl.where(best > NEG, s_tok, NEG)
    return tok, s_tok, best


@triton.jit
def _scan(
    base, lo, hi, row, slot, V, W, T, thr, m_s, s_x, floor, k0, k1,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    DRAW: tl.constexpr, COUNT: tl.constexpr, MASS: tl.constexpr, TOTAL: tl.constexpr,
    SKIP: tl.constexpr = True, STAGES: tl.constexpr = 1, PREFETCH: tl.constexpr = 1,
):
    """One pass over the survivors (processed / T >= thr) of ``[lo, hi)`` of a row. DRAW: the
    Gumbel-max over the survivors strictly above ``floor`` (token, its value;
    :func:`_draw_tile`, SKIP as there). COUNT / MASS: survivors strictly above ``s_x`` and
    their mass exp(s - m_s). TOTAL: survivors and their mass. Returns (token, its value,
    count, mass, survivors, their mass, best score)."""
    NEG = float("-inf")
    BLOCK: tl.constexpr = R * VEC
    acc_sv = tl.full([R], NEG, tl.float32)
    acc_si = tl.zeros([R], dtype=tl.int32)
    acc_ss = tl.full([R], NEG, tl.float32)
    acc_c = tl.zeros([R], dtype=tl.int32)
    acc_g = tl.zeros([R], dtype=tl.float32)
    acc_n = tl.zeros([R], dtype=tl.int32)
    acc_z = tl.zeros([R], dtype=tl.float32)
    best = float("-inf")
    inv_t = 1.0 / T
    pre, pre2 = _first_tiles(base, lo, hi, R, VEC, PREFETCH)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        cur, pre, pre2 = _next_tile(base, start, hi, pre, pre2, R, VEC, PREFETCH)
        offs, vmask, raw, x = _tile_of(
            cur, start, row, slot, V, W, hi, pbits_ptr, pmask_ptr, counts_ptr, rep,
            freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr,
            NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
        if DRAW & SKIP & (not COUNT):  # a draw alone: divide only where it may win
            acc_sv, acc_si, acc_ss, best = _draw_tile_lazy(
                x, T, inv_t, thr, floor, offs, k0, k1, acc_sv, acc_si, acc_ss, best)
        else:
            s = tl.math.div_rn(x, T)
            valid = (s >= thr) & (s > NEG)
            if DRAW:
                kept = valid & (s > floor)
                acc_sv, acc_si, acc_ss, best = _draw_tile(
                    tl.where(kept, s, NEG), kept, offs, k0, k1, acc_sv, acc_si, acc_ss, best,
                    SKIP)
        if COUNT:
            gt = valid & (s > s_x)
            acc_c += tl.sum(gt.to(tl.int32), 1)
            if MASS | TOTAL:
                e = _exp(s - m_s)
                if MASS:
                    acc_g += tl.sum(tl.where(gt, e, 0.0), 1)
                if TOTAL:
                    acc_n += tl.sum(valid.to(tl.int32), 1)
                    acc_z += tl.sum(tl.where(valid, e, 0.0), 1)
    tok, s_tok, best = _draw_result(acc_sv, acc_si, acc_ss)
    return (tok, s_tok, tl.sum(acc_c, 0), tl.sum(acc_g, 0), tl.sum(acc_n, 0),
            tl.sum(acc_z, 0), best)


@triton.jit
def _draw_then_verify(
    base, row, slot, V, W, T, thr, m_s, top_k, top_p, k_on, p_on, k0, k1, have1, tok1, s_x1,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ROUNDS: tl.constexpr, STAGES: tl.constexpr = 1, PREFETCH: tl.constexpr = 1,
):
    """Top-k / top-p by drawing first: the Gumbel-max draw ``x`` over the min-p survivors,
    then a pass that decides whether ``x`` is in the kept set.

    The Gumbel-max over a subset that contains the unrestricted winner is that winner, so when
    ``x`` is kept it is exactly the draw over the kept set (same noise, same tie rule). ``x``
    is kept by top-k iff fewer than k survivors are strictly greater; by top-p iff it is the
    largest, or the mass strictly above it is ``< p`` of the mass top-k keeps (the
    tie-extended prefix rule of SAMPLER_SPEC section 2). With both on, that mass is known
    here only when top-k keeps every survivor (at most k of them). The kept set lies strictly
    above a rejected draw, so the next draw is over the survivors above it (same noise): each
    later pass verifies one draw and makes the next. Returns (token, kept); a row that is not
    settled after ROUNDS such passes takes the exact selection path. ``have1``: the first
    draw (``tok1``, its value ``s_x1``) was made in pass 1."""
    NEG = float("-inf")
    if have1:
        tok = tok1
        s_x = s_x1
    else:
        tok, s_x, _c, _g, _n, _z, _b = _scan(
            base, 0, V, row, slot, V, W, T, thr, m_s, NEG, NEG, k0, k1,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
            DRAW=True, COUNT=False, MASS=False, TOTAL=False, STAGES=STAGES,
            PREFETCH=PREFETCH)
    _t, _s, n_gt, m_gt, n_valid, z, _b = _scan(
        base, 0, V, row, slot, V, W, T, thr, m_s, s_x, NEG, k0, k1,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
        DRAW=False, COUNT=True, MASS=True, TOTAL=True, STAGES=STAGES,
        PREFETCH=PREFETCH)
    known_z = (not k_on) | (n_valid <= top_k)
    ok = (s_x > NEG) & _in_kept(n_gt, m_gt, z, top_k, top_p, k_on, p_on) & known_z
    if known_z & (s_x > NEG) & (not ok):
        tok, s_x, _c, _g, _n, _z, _b = _scan(
            base, 0, V, row, slot, V, W, T, thr, m_s, NEG, s_x, k0, k1,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
            DRAW=True, COUNT=False, MASS=False, TOTAL=False, STAGES=STAGES,
            PREFETCH=PREFETCH)
        rounds = 0
        while (not ok) & (rounds < ROUNDS):
            nxt, s_nxt, n_gt, m_gt, _n, _z, _b = _scan(
                base, 0, V, row, slot, V, W, T, thr, m_s, s_x, s_x, k0, k1,
                pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
                bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
                ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
                R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
                DRAW=True, COUNT=True, MASS=True, TOTAL=False, STAGES=STAGES,
                PREFETCH=PREFETCH)
            ok = (s_x > NEG) & _in_kept(n_gt, m_gt, z, top_k, top_p, k_on, p_on)
            if not ok:
                tok = nxt
                s_x = s_nxt
            rounds += 1
    return tok, ok


@triton.jit
def _in_kept(n_gt, m_gt, z, top_k, top_p, k_on, p_on):
    ok_k = (not k_on) | (n_gt <= top_k - 1)
    ok_p = (not p_on) | (n_gt == 0) | (m_gt < top_p * z)
    return ok_k & ok_p


@triton.jit
def _fused_sampler_kernel(
    logits_ptr, stride_row, V, W,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr,
    pbits_ptr, pmask_ptr, counts_ptr,
    bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP,
    ban_ptr, NBAN,
    allowed_ptr, gbits_ptr, grow_ptr, GW,
    cand_ptr, counter_ptr, part_ptr, part_i_ptr, NCHUNK,
    tok_ptr, lp_ptr, rank_ptr, topk_id_ptr, topk_val_ptr, KOUT, thr_ptr, done_ptr,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
    ANY_LP: tl.constexpr, ANY_RANDOM: tl.constexpr, ANY_SEL: tl.constexpr,
    ANY_MASS: tl.constexpr, ANY_RK: tl.constexpr, HIST: tl.constexpr, SKIP: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr,
    MAX_PASSES: tl.constexpr, W0: tl.constexpr, SPLIT: tl.constexpr, NCP2: tl.constexpr,
    FAST: tl.constexpr, HAS_DONE: tl.constexpr, STAGES: tl.constexpr = 1,
    PREFETCH: tl.constexpr = 1, r_counts_ptr=None, r_pbits_ptr=None, r_tbits_ptr=None,
    r_recent_ptr=None, R_RW=1, RECORD: tl.constexpr = False, R_COUNTS: tl.constexpr = False,
    R_TOUCH: tl.constexpr = False, R_RECENT: tl.constexpr = False, R_RWP2: tl.constexpr = 1,
):
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    if HAS_DONE:  # rows the chunked pipeline settled (sampler.kernels.chunked) are left alone
        if tl.load(done_ptr + row) != 0:
            return
    slot = tl.load(idx_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    T = tl.load(fparams_ptr + slot * stride_f + 0)
    top_p = tl.load(fparams_ptr + slot * stride_f + 1)
    log_min_p = tl.load(fparams_ptr + slot * stride_f + 2)
    rep = tl.load(fparams_ptr + slot * stride_f + 3)
    freq = tl.load(fparams_ptr + slot * stride_f + 4)
    pres = tl.load(fparams_ptr + slot * stride_f + 5)
    seed = tl.load(iparams_ptr + slot * stride_i + 0)
    sidx = tl.load(iparams_ptr + slot * stride_i + 1)
    top_k = tl.load(iparams_ptr + slot * stride_i + 2)
    min_tokens = tl.load(iparams_ptr + slot * stride_i + 3)
    nlp = tl.load(iparams_ptr + slot * stride_i + 4)
    mode = tl.load(iparams_ptr + slot * stride_i + 5)
    greedy = tl.load(iparams_ptr + slot * stride_i + 6) != 0
    row_allowed = tl.load(iparams_ptr + slot * stride_i + 7) != 0
    mrow = _mask_row(grow_ptr, row, HAS_GRAMMAR)
    pos = tl.load(positions_ptr + slot)
    row_pen = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    min_tok_active = pos < min_tokens
    raw_family = (mode == 0) | (mode == 1) | (mode == 4)
    lp_on = (nlp != -2) & raw_family & (nlp >= 0)
    NEG = float("-inf")
    lane = tl.arange(0, R)
    k0 = _row_key(seed, sidx, pos, tl.full((), LANE0, tl.uint32))
    k1 = _row_key(seed, sidx, pos, tl.full((), LANE1, tl.uint32))
    fk_on = (top_k > 0) & (top_k < V)
    fp_on = top_p < 1.0
    # draw first (then verify) only where top-k is off or beyond the lane count: top-k
    # within it is one gather pass below
    fast_row = (not greedy) & (fk_on | fp_on) & ((not fk_on) | (top_k > R))
    # a random row without min-p draws over every finite value: pass 1 makes that draw when
    # it is needed (no top-k / top-p, or drawing first)
    draw1 = False
    d_tok = 0
    d_sx = NEG
    DRAW1: tl.constexpr = ANY_RANDOM & (not SPLIT)
    if DRAW1:
        plain_row = (not greedy) & (not fk_on) & (not fp_on)
        if FAST & ANY_SEL:
            draw1 = (log_min_p == NEG) & (plain_row | fast_row)
        else:
            draw1 = (log_min_p == NEG) & plain_row

    # ---------------------------------------------------------------- pass 1: row statistics
    if SPLIT:  # computed by _stats_kernel over vocab chunks: combine its partials
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
    else:
        acc_bv, acc_bi, acc_ms, acc_mr, acc_lr, acc_mt, acc_lt, d_sv, d_si, d_ss = _stats_range(
            base, 0, V, row, slot, V, W, T, greedy, lp_on, mode,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR, ANY_LP,
            ANY_RANDOM,
            STAGES=STAGES, DRAW1=DRAW1, draw1=draw1, k0=k0, k1=k1, PREFETCH=PREFETCH)
        if DRAW1:
            d_tok, d_sx, _db = _draw_result(d_sv, d_si, d_ss)
    best_v, best_i = _best(acc_bv, acc_bi)
    m_s = tl.max(acc_ms, 0)
    m_r = tl.max(acc_mr, 0)
    lse_r = _lse(acc_mr, acc_lr)
    lse_t = _lse(acc_mt, acc_lt)

    # ---------------------------------------------------------------- draw first, then verify
    thr = m_s + log_min_p
    fast_done = False
    fast_tok = 0
    if FAST & ANY_RANDOM & ANY_SEL:
        if fast_row:
            fast_tok, fast_done = _draw_then_verify(
                base, row, slot, V, W, T, thr, m_s, top_k, top_p, fk_on, fp_on, k0, k1, draw1,
                d_tok, d_sx,
                pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
                bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
                ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
                R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR, ROUNDS=6,
                STAGES=STAGES, PREFETCH=PREFETCH)

    # ---------------------------------------------------------------- selection state machines
    v_k = NEG
    v_p = NEG
    from_cands = False
    p_n = 0
    r_n = 0
    r_hi = float("inf")
    sel_on = False
    rk_on = False
    r_t0 = NEG
    cand_p = cand_ptr + row.to(tl.int64) * (2 * CAP)
    cand_r = cand_p + CAP
    ctr_p = counter_ptr + row * 2
    ctr_r = ctr_p + 1
    if ANY_SEL | ANY_RK:
        k_on = (top_k > 0) & (top_k < V)
        p_on = top_p < 1.0
        sel_on = (not greedy) & (k_on | p_on) & (not fast_done)
        # P phases: 0 top-k refine, 1 top-k gather, 2 top-p refine, 3 top-p gather, 4 done
        p_phase = tl.where(sel_on, tl.where(k_on, 0, 2), 4)
        p_lo = 0.0
        p_hi = float("inf")
        p_w = W0
        p_nlo = 0
        p_mlo = 0.0
        p_fresh = True
        p_all = False
        # top-k: gather every survivor >= the k-th largest lane maximum in one pass (falls
        # back to the refinement passes when more than CAP tokens are that large)
        p_t0 = NEG
        p_lane = sel_on & k_on & (top_k <= acc_ms.shape[0])
        if p_lane:
            p_t0 = _kth_largest(acc_ms, top_k)
            p_phase = 1
            p_all = True
        p_Z = 0.0
        p_floor = thr
        rk_on = lp_on & (nlp > 0)
        r_phase = tl.where(rk_on, 0, 2)
        r_lo = 0.0
        r_w = W0
        r_nlo = 0
        r_lane = rk_on & (nlp <= acc_mr.shape[0])
        if r_lane:  # the same one-pass gather for the top-k logprobs
            r_t0 = _kth_largest(acc_mr, nlp)
            r_phase = 1
        jj = tl.arange(0, NP)
        passes = 0
        while ((p_phase < 4) | (r_phase < 2)) & (passes < MAX_PASSES):
            passes += 1
            p_mass = (p_phase == 2)
            cnt_p = tl.zeros([NP], dtype=tl.int32)
            mss_p = tl.zeros([NP], dtype=tl.float32)
            cnt_r = tl.zeros([NP], dtype=tl.int32)
            acc_above = tl.full([R], float("inf"), tl.float32)  # min value above the bin
            if (p_phase == 1) | (p_phase == 3):
                tl.store(ctr_p, 0)
            if r_phase == 1:
                tl.store(ctr_r, 0)
            tl.debug_barrier()
            pre, pre2 = _first_tiles(base, 0, V, R, VEC, PREFETCH)
            for start in range(0, V, BLOCK):
                cur, pre, pre2 = _next_tile(base, start, V, pre, pre2, R, VEC, PREFETCH)
                offs, vmask, raw, x = _tile_of(
                    cur, start, row, slot, V, W, V, pbits_ptr, pmask_ptr, counts_ptr, rep,
                    freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr,
                    NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow,
                    GW,
                    R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
                if p_phase < 4:
                    s = tl.math.div_rn(x, T)
                    valid = (s >= p_floor) & (s > NEG)
                    d = m_s - s
                    if (p_phase == 0) | (p_phase == 2):
                        b = tl.where(valid, _bin_of(d, p_lo, p_w, p_hi, NP), NP - 1)
                        cnt_p += _count_bins(b, jj, NP, HIST, R, VEC)
                        if ANY_MASS & p_mass:
                            mss_p += _mass_bins(b, _exp(s - m_s), jj, NP, R)
                    else:
                        sel = valid & (d < p_hi) & (p_all | (d >= p_lo)) & (s >= p_t0)
                        _append(cand_p, ctr_p, sel, _order_key(s, offs), CAP)
                        above = tl.where(valid & (d < p_lo), s, float("inf"))
                        acc_above = tl.minimum(acc_above, tl.min(above, 1))
                if ANY_LP:
                    if r_phase < 2:
                        valid_r = raw > NEG
                        d_r = m_r - raw
                        if r_phase == 0:
                            br = tl.where(valid_r, _bin_of(d_r, r_lo, r_w, r_hi, NP), NP - 1)
                            cnt_r += _count_bins(br, jj, NP, HIST, R, VEC)
                        else:
                            sel_r = valid_r & (d_r < r_hi) & (raw >= r_t0)
                            mv = _mode_value(raw, mode, T, lse_r, lse_t)
                            _append(cand_r, ctr_r, sel_r, _order_key(mv, offs), CAP)
            tl.debug_barrier()
            # ---- P update
            if (p_phase == 0) | (p_phase == 2):
                if p_mass & p_fresh:
                    p_Z = tl.sum(tl.where(jj < NP - 1, mss_p, 0.0), 0)
                j, nb4, mb4, nb, reached = _choose_bin(
                    cnt_p, mss_p, p_nlo, p_mlo, top_k, top_p * p_Z, p_mass, NP)
                if not reached:
                    # fewer survivors than k: top-k keeps everything
                    if p_on:
                        p_phase = 2
                        p_lo = 0.0
                        p_hi = float("inf")
                        p_w = W0
                        p_nlo = 0
                        p_mlo = 0.0
                        p_fresh = True
                    else:
                        p_phase = 4
                else:
                    e_lo = p_lo + j.to(tl.float32) * p_w
                    e_hi = tl.where(j == NP - 2, p_hi, p_lo + (j + 1).to(tl.float32) * p_w)
                    p_lo = e_lo
                    p_hi = e_hi
                    p_nlo = nb4
                    p_mlo = mb4
                    p_fresh = False
                    # a bin one float wide holds a single value (a run of ties): no narrower
                    # bin can split it, and its gathered part has that value throughout
                    single = e_hi <= _next_up(e_lo)
                    if nb4 + nb <= CAP:
                        p_all = True
                        p_phase += 1
                    elif (nb <= CAP) | (passes >= MAX_PASSES - 2) | single:
                        p_all = False
                        p_phase += 1
                    else:
                        p_w = _next_width(p_lo, p_hi, p_w, NP)
            elif p_lane & (tl.atomic_add(ctr_p, 0) > CAP):  # too many: refine instead
                p_lane = False
                p_t0 = NEG
                p_all = False
                p_phase = 0
            elif (p_phase == 1) | (p_phase == 3):
                p_n = tl.minimum(tl.atomic_add(ctr_p, 0), CAP)
                keys = tl.sort(_read_cands(cand_p, p_n, CAP), 0, descending=True)
                tl.debug_barrier()
                tl.store(cand_p + tl.arange(0, CAP), keys)
                vals = _key_value(keys)
                ii = tl.arange(0, CAP)
                inlist = ii < p_n
                if p_phase == 1:
                    r = tl.where(p_all, top_k - 1, top_k - p_nlo - 1).to(tl.int32)
                    # a truncated single-value bin: every entry has the k-th value
                    r = tl.where(p_all, r, tl.minimum(r, p_n - 1))
                    v_k = tl.sum(tl.where(ii == r, vals, 0.0), 0)
                    # a lane gather holding fewer than k tokens holds every survivor
                    v_k = tl.where(p_lane & (p_n <= r), NEG, v_k)
                    p_lane = False
                    from_cands = p_all
                    if p_on:
                        if p_all:
                            v_p = _top_p_within(vals, inlist & (vals >= v_k), m_s, top_p)
                            p_phase = 4
                        else:
                            p_phase = 2
                            p_floor = tl.maximum(thr, v_k)
                            p_lo = 0.0
                            p_hi = float("inf")
                            p_w = W0
                            p_nlo = 0
                            p_mlo = 0.0
                            p_fresh = True
                    else:
                        p_phase = 4
                else:
                    e = tl.where(inlist, _exp(vals - m_s), 0.0)
                    c = tl.where(p_all, 0.0, p_mlo) + tl.cumsum(e, 0)  # mass through i
                    excl = c - e
                    limit = top_p * p_Z
                    ok = inlist & (excl < limit)
                    ok = ok | (inlist & (ii == 0) & (p_all | (p_nlo == 0)))
                    last = tl.max(tl.where(ok, ii, -1), 0)
                    # no boundary token is kept when the mass above the bin already reaches
                    # p (float rounding at a bin edge): keep exactly the tokens above it
                    v_p = tl.where(last >= 0, tl.sum(tl.where(ii == last, vals, 0.0), 0),
                                   tl.min(acc_above, 0))
                    from_cands = p_all
                    p_phase = 4
            if ANY_LP:
                if r_phase == 0:
                    j, nb4, mb4, nb, reached = _choose_bin(
                        cnt_r, cnt_r.to(tl.float32), r_nlo, 0.0, nlp, 0.0, False, NP)
                    e_lo = r_lo + j.to(tl.float32) * r_w
                    e_hi = tl.where(j == NP - 2, r_hi, r_lo + (j + 1).to(tl.float32) * r_w)
                    if ((not reached) | (nb4 + nb <= CAP) | (passes >= MAX_PASSES - 2)
                            | (e_hi <= _next_up(e_lo))):
                        r_hi = tl.where(reached, e_hi, float("inf"))
                        r_phase = 1
                    else:
                        r_lo = e_lo
                        r_hi = e_hi
                        r_nlo = nb4
                        r_w = _next_width(r_lo, r_hi, r_w, NP)
                elif r_lane & (tl.atomic_add(ctr_r, 0) > CAP):  # too many: refine instead
                    r_lane = False
                    r_t0 = NEG
                    r_phase = 0
                elif r_phase == 1:
                    r_n = tl.minimum(tl.atomic_add(ctr_r, 0), CAP)
                    keys = tl.sort(_read_cands(cand_r, r_n, CAP), 0, descending=True)
                    tl.debug_barrier()
                    tl.store(cand_r + tl.arange(0, CAP), keys)
                    r_phase = 2
            tl.debug_barrier()

    # ---------------------------------------------------------------- sampling
    tok = best_i
    v_star = NEG
    if ANY_RANDOM:
        if not greedy:
            v_star = tl.maximum(thr, tl.maximum(v_k, v_p))
            if fast_done:
                tok = fast_tok
            elif draw1 & (v_star == NEG):  # the kept set is every finite value: pass 1's draw
                tok = d_tok
            elif sel_on & from_cands:
                ii = tl.arange(0, CAP)
                keys = tl.load(cand_p + ii, cache_modifier=".cg")
                vals = _key_value(keys)
                ids = _key_id(keys)
                tok = _gumbel_max_of(vals, ids, (ii < p_n) & (vals >= v_star), k0, k1)
            else:  # the Gumbel-max over the kept set {s >= v_star}, one pass over the row
                tok, _s, _c, _g, _n, _z, _b = _scan(
                    base, 0, V, row, slot, V, W, T, v_star, m_s, NEG, NEG, k0, k1,
                    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
                    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
                    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
                    R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
                    DRAW=True, COUNT=False, MASS=False, TOTAL=False, SKIP=SKIP, STAGES=STAGES,
                    PREFETCH=PREFETCH)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(thr_ptr + row, v_star)

    # ---------------------------------------------------------------- logprobs (raw family)
    if ANY_LP:
        v_tok = float("nan")
        rank = 0
        if lp_on:
            raw_tok, v_tok = _token_value(base, tok, mode, T, lse_r, lse_t)
            rank = 1
            if raw_tok < m_r:
                if rk_on & ((m_r - raw_tok) < r_hi) & (raw_tok >= r_t0):
                    ii = tl.arange(0, CAP)
                    keys = tl.load(cand_r + ii, cache_modifier=".cg")
                    vals = _key_value(keys)
                    rank = 1 + tl.sum(((ii < r_n) & (vals > v_tok)).to(tl.int32), 0)
                else:
                    acc_c = tl.zeros([R], dtype=tl.int32)
                    for start in range(0, V, BLOCK):
                        offs = start + lane[:, None] * VEC + tl.arange(0, VEC)[None, :]
                        raw = tl.load(base + offs, mask=offs < V, other=NEG).to(tl.float32)
                        mv = _mode_value(raw, mode, T, lse_r, lse_t)
                        acc_c += tl.sum((mv > v_tok).to(tl.int32), 1)
                    rank = 1 + tl.sum(acc_c, 0)
        tl.store(lp_ptr + row, v_tok)
        tl.store(rank_ptr + row, rank.to(tl.int64))
        ii = tl.arange(0, CAP)
        ids_out = tl.full([CAP], -1, tl.int64)
        vals_out = tl.full([CAP], NEG, tl.float32)
        if rk_on:
            keys = tl.load(cand_r + ii, cache_modifier=".cg")
            have = (ii < r_n) & (ii < nlp)
            ids_out = tl.where(have, _key_id(keys).to(tl.int64), -1)
            vals_out = tl.where(have, _key_value(keys), NEG)
        tl.store(topk_id_ptr + row * KOUT + ii, ids_out, mask=ii < KOUT)
        tl.store(topk_val_ptr + row * KOUT + ii, vals_out, mask=ii < KOUT)
    if RECORD:  # the row's slot advanced by its token (the ``r_*`` tables are the state's)
        _record_row(slot, tok.to(tl.int64), positions_ptr, r_counts_ptr, r_pbits_ptr,
                    r_tbits_ptr, fparams_ptr, stride_f, r_recent_ptr, V, W, R_RW,
                    R_COUNTS, R_TOUCH, R_RECENT, R_RWP2)


@triton.jit
def _stats_kernel(
    logits_ptr, stride_row, V, W,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr,
    pbits_ptr, pmask_ptr, counts_ptr, bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP, ban_ptr, NBAN, allowed_ptr, gbits_ptr, grow_ptr, GW,
    part_ptr, part_i_ptr, NCHUNK, CHUNK, lanes_ptr, KM,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
    ANY_LP: tl.constexpr,
    ANY_RANDOM: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, LANES: tl.constexpr,
    STAGES: tl.constexpr = 1, PREFETCH: tl.constexpr = 1,
):
    """Pass 1 of the fused kernel split over vocab chunks (grid rows x chunks), so short
    batches still spread the first read of the logits over the whole GPU. Writes per-chunk
    partials: greedy (value, index), max of x / T, and (max, sum) of the two log-sum-exps.
    LANES: also the chunk's ``KM`` largest per-lane maxima of x / T and of the raw values,
    descending (``lanes_ptr``: ``[rows, chunks, 2, KM]``), for the chunked pipeline's top-k
    bounds (:mod:`sampler.kernels.chunked`)."""
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
        STAGES=STAGES, PREFETCH=PREFETCH)
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
    if LANES:
        jj = tl.arange(0, R)
        lanes = lanes_ptr + (row * NCHUNK + c).to(tl.int64) * (2 * KM)
        tl.store(lanes + jj, tl.sort(acc_ms, 0, descending=True), mask=jj < KM)
        tl.store(lanes + KM + jj, tl.sort(acc_mr, 0, descending=True), mask=jj < KM)
