"""The fused sampling kernel: steps 2-12 and the raw-family logprobs of a batch, one program
per row, without a ``[rows, vocab]`` float32 tensor.

The kernel runs the pipeline's passes over a row in order, one helper each: pass 1, the row
statistics (:mod:`sampler.kernels.row_stats`); draw first, then verify
(:mod:`sampler.kernels.draw`); the selection (:mod:`sampler.kernels.fused_selection`); the
draw (:func:`_sample`); the logprobs (:func:`_write_logprobs`). Processed logprobs modes and
whole-vocab (-1) logprobs are not computed here (the launcher runs the torch path for them).
With ``HAS_DONE`` the rows the candidate path settled are skipped; with ``SPLIT`` pass 1 comes
from :func:`sampler.kernels.row_stats._stats_kernel`'s chunk partials; with ``RECORD`` each
row also advances its slot. How the passes work: docs/sampler_kernels.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.draw import _draw_result, _draw_then_verify, _gumbel_max_of, _scan
from sampler.kernels.fused_selection import _select
from sampler.kernels.noise import LANE0, LANE1, _row_key
from sampler.kernels.record import _record_row
from sampler.kernels.reductions import _best, _lse, _mode_value, _sampled_value
from sampler.kernels.row_stats import _chunk_stats, _stats_range
from sampler.kernels.select import _key_id, _key_value
from sampler.kernels.token_bitmask_kernel import _mask_row


@triton.jit
def _sample(
    base, row, slot, V, W, T, thr, m_s, greedy, best_i, v_k, v_p, fast_done, fast_tok,
    draw1, d_tok, sel_on, from_cands, cand_p, p_n, k0, k1,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ANY_RANDOM: tl.constexpr, SKIP: tl.constexpr, CAP: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The draw step: (token, kept-set threshold ``v_star``). Greedy rows keep pass 1's
    argmax; a random row takes the draw-then-verify token, else pass 1's draw when every
    finite value is kept, else the Gumbel-max over the candidate list when it holds the kept
    set, else one pass over the row."""
    NEG = float("-inf")
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
                    DRAW=True, COUNT=False, MASS=False, TOTAL=False, SKIP=SKIP,
                    PREFETCH=PREFETCH)
    return tok, v_star


@triton.jit
def _write_logprobs(
    base, row, V, tok, lp_on, rk_on, nlp, mode, T, m_r, lse_r, lse_t, r_hi, r_t0, r_n, cand_r,
    lp_ptr, rank_ptr, topk_id_ptr, topk_val_ptr, KOUT,
    R: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
):
    """The logprobs step (raw-family modes): the sampled token's value and rank (from the raw
    list when it holds every larger value, else a counting pass) and the top-k list."""
    NEG = float("-inf")
    lane = tl.arange(0, R)
    raw_tok, v_tok, rank = _sampled_value(base, tok, lp_on, mode, T, lse_r, lse_t)
    if lp_on & (raw_tok < m_r):
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
    FAST: tl.constexpr, HAS_DONE: tl.constexpr, PREFETCH: tl.constexpr = 1,
    r_counts_ptr=None, r_pbits_ptr=None, r_tbits_ptr=None,
    r_recent_ptr=None, R_RW=1, RECORD: tl.constexpr = False, R_COUNTS: tl.constexpr = False,
    R_TOUCH: tl.constexpr = False, R_RECENT: tl.constexpr = False, R_RWP2: tl.constexpr = 1,
):
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    if HAS_DONE:  # rows the candidate path settled are left alone
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
        acc_bv, acc_bi, acc_ms, acc_mr, acc_lr, acc_mt, acc_lt = _chunk_stats(
            part_ptr, part_i_ptr, row, NCHUNK, NCP2)
    else:
        acc_bv, acc_bi, acc_ms, acc_mr, acc_lr, acc_mt, acc_lt, d_sv, d_si, d_ss = _stats_range(
            base, 0, V, row, slot, V, W, T, greedy, lp_on, mode,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED,
            HAS_GRAMMAR, ANY_LP, ANY_RANDOM,
            DRAW1=DRAW1, draw1=draw1, k0=k0, k1=k1, PREFETCH=PREFETCH)
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
                PREFETCH=PREFETCH)

    # ---------------------------------------------------------------- selection
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
        v_k, v_p, from_cands, p_n, r_n, r_hi, sel_on, rk_on, r_t0 = _select(
            base, row, slot, V, W, T, thr, m_s, m_r, lse_r, lse_t, top_k, top_p, greedy,
            fast_done, lp_on, nlp, mode, acc_ms, acc_mr, cand_p, cand_r, ctr_p, ctr_r,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED,
            HAS_GRAMMAR, ANY_LP, ANY_MASS,
            HIST, BLOCK, NP, CAP, MAX_PASSES, W0, PREFETCH)

    # ---------------------------------------------------------------- the draw
    tok, v_star = _sample(
        base, row, slot, V, W, T, thr, m_s, greedy, best_i, v_k, v_p, fast_done, fast_tok,
        draw1, d_tok, sel_on, from_cands, cand_p, p_n, k0, k1,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED,
        HAS_GRAMMAR, ANY_RANDOM, SKIP, CAP,
        PREFETCH)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(thr_ptr + row, v_star)

    # ---------------------------------------------------------------- logprobs (raw family)
    if ANY_LP:
        _write_logprobs(base, row, V, tok, lp_on, rk_on, nlp, mode, T, m_r, lse_r, lse_t,
                        r_hi, r_t0, r_n, cand_r, lp_ptr, rank_ptr, topk_id_ptr, topk_val_ptr,
                        KOUT, R, VEC, BLOCK, CAP)
    if RECORD:  # the row's slot advanced by its token (the ``r_*`` tables are the state's)
        _record_row(slot, tok.to(tl.int64), positions_ptr, r_counts_ptr, r_pbits_ptr,
                    r_tbits_ptr, fparams_ptr, stride_f, r_recent_ptr, V, W, R_RW,
                    R_COUNTS, R_TOUCH, R_RECENT, R_RWP2)
