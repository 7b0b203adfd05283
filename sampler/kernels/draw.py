"""The Gumbel-max draw: per-tile accumulators that skip the noise's logarithms where a tile
cannot win, a pass over a row's survivors (:func:`_scan`), and top-k / top-p by drawing first
and verifying (:func:`_draw_then_verify`; docs/sampler_kernels.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.noise import _gumbel, _gumbel_bits, _gumbel_of_bits, _gumbel_upper
from sampler.kernels.reductions import _div_t, _exp
from sampler.kernels.tiles import _first_tiles, _next_tile, _tile_of


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
        s = _div_t(x, T)
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
    SKIP: tl.constexpr = True, PREFETCH: tl.constexpr = 1,
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
    for start in tl.range(lo, hi, BLOCK, num_stages=1):  # not software-pipelined
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
            s = _div_t(x, T)
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
def _in_kept(n_gt, m_gt, z, top_k, top_p, k_on, p_on):
    ok_k = (not k_on) | (n_gt <= top_k - 1)
    ok_p = (not p_on) | (n_gt == 0) | (m_gt < top_p * z)
    return ok_k & ok_p


@triton.jit
def _draw_then_verify(
    base, row, slot, V, W, T, thr, m_s, top_k, top_p, k_on, p_on, k0, k1, have1, tok1, s_x1,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ROUNDS: tl.constexpr, PREFETCH: tl.constexpr = 1,
):
    """Top-k / top-p by drawing first: the Gumbel-max draw ``x`` over the min-p survivors,
    then a pass that decides whether ``x`` is in the kept set; a rejected draw is followed by
    the draw over the survivors above it, verified in the same pass (why this is the draw over
    the kept set: docs/sampler_kernels.md). Returns (token, kept); a row not settled after
    ROUNDS such passes takes the selection passes. ``have1``: the first draw (``tok1``, its
    value ``s_x1``) was made in pass 1."""
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
            DRAW=True, COUNT=False, MASS=False, TOTAL=False, PREFETCH=PREFETCH)
    _t, _s, n_gt, m_gt, n_valid, z, _b = _scan(
        base, 0, V, row, slot, V, W, T, thr, m_s, s_x, NEG, k0, k1,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
        DRAW=False, COUNT=True, MASS=True, TOTAL=True, PREFETCH=PREFETCH)
    known_z = (not k_on) | (n_valid <= top_k)
    ok = (s_x > NEG) & _in_kept(n_gt, m_gt, z, top_k, top_p, k_on, p_on) & known_z
    if known_z & (s_x > NEG) & (not ok):
        tok, s_x, _c, _g, _n, _z, _b = _scan(
            base, 0, V, row, slot, V, W, T, thr, m_s, NEG, s_x, k0, k1,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
            DRAW=True, COUNT=False, MASS=False, TOTAL=False, PREFETCH=PREFETCH)
        rounds = 0
        while (not ok) & (rounds < ROUNDS):
            nxt, s_nxt, n_gt, m_gt, _n, _z, _b = _scan(
                base, 0, V, row, slot, V, W, T, thr, m_s, s_x, s_x, k0, k1,
                pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
                bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
                ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
                R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
                DRAW=True, COUNT=True, MASS=True, TOTAL=False, PREFETCH=PREFETCH)
            ok = (s_x > NEG) & _in_kept(n_gt, m_gt, z, top_k, top_p, k_on, p_on)
            if not ok:
                tok = nxt
                s_x = s_nxt
            rounds += 1
    return tok, ok
