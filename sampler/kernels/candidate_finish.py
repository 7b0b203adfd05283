"""The candidate path's second kernel: one program per row over the lists
:mod:`sampler.kernels.candidate_stats` left.

``_cand_finish_kernel`` processes the touched tokens, sorts the list and does steps 7-12 and
the logprobs on it with the fused kernel's arithmetic. A row whose list may miss a token that
matters is flagged ``done = 0`` and left to the fused kernel; ``done = 2``: settled but for its
rank (:mod:`sampler.kernels.rank`). Why the list suffices: docs/sampler_kernels.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.candidate_stats import _cand_row, _chunk_partials
from sampler.kernels.draw import _gumbel_max_of
from sampler.kernels.kernel_config import REC_LSE_R, REC_LSE_T, REC_WIDTH
from sampler.kernels.noise import LANE0, LANE1, _row_key
from sampler.kernels.process import _processed, _row_processing
from sampler.kernels.record import _record_row
from sampler.kernels.reductions import _mode_value, _sampled_value
from sampler.kernels.select import _key_id, _key_value, _order_key, _top_p_within
from sampler.ops.bad_words import PAD_ANY

KEY_NONE: tl.constexpr = tl.constexpr(-9223372036854775807 - 1)  # below every value's key
PAD: tl.constexpr = tl.constexpr(PAD_ANY)


@triton.jit
def _row_bans(words_ptr, wlens_ptr, NW, WL, recent_ptr, RW, slot,
              NWP2: tl.constexpr, WLP2: tl.constexpr):
    """``[NWP2]``: the last token of each of the slot's bad words whose prefix matches its
    recent output tokens, else -1 (:func:`sampler.kernels.tables.compute_bad_word_bans`)."""
    w = tl.arange(0, NWP2)
    col = tl.arange(0, WLP2)
    wm = w < NW
    wrow = words_ptr + slot * NW * WL
    pm = col < WL - 1  # the prefix columns
    prefix = tl.load(wrow + w[:, None] * WL + col[None, :], mask=wm[:, None] & pm[None, :],
                     other=PAD)
    recent = tl.load(recent_ptr + slot * RW + (RW - (WL - 1)) + col, mask=pm, other=PAD)
    match = (prefix == recent[None, :]) | (prefix == PAD)
    matched = tl.min(match.to(tl.int32), 1) != 0
    last = tl.load(wrow + w * WL + (WL - 1), mask=wm, other=-1)
    lens = tl.load(wlens_ptr + slot * NW + w, mask=wm, other=0)
    return tl.where(matched & (lens > 0), last, -1)


@triton.jit
def _list_of(lval, lid, n, S: tl.constexpr):
    """The first ``n`` entries of a row's list in a ``[S]`` block: (index, in list, raw
    values, ids)."""
    ii = tl.arange(0, S)
    inl = ii < n
    return (ii, inl, tl.load(lval + ii, mask=inl, other=float("-inf"), cache_modifier=".cg"),
            tl.load(lid + ii, mask=inl, other=0, cache_modifier=".cg"))


@triton.jit
def _draw_from(lval, lid, prow, n, n_d, T, top_k, top_p, log_min_p, l_z, t, k0, k1,
               S: tl.constexpr):
    """Steps 8-12 of a random row over its ``n <= S`` listed tokens (the first ``n_d`` dense:
    processed = raw; the rest touched, processed values in ``prow``): (token, kept-set
    threshold, 1, or 0 when a token beyond the list could be kept)."""
    NEG = float("-inf")
    ii, inl, raw_c, ids_c = _list_of(lval, lid, n, S)
    proc = tl.where(ii < n_d, raw_c,
                    tl.load(prow + ii, mask=inl & (ii >= n_d), other=NEG, cache_modifier=".cg"))
    fin = inl & (proc > NEG)
    z = tl.math.div_rn(tl.where(fin, proc, 1.0), T)  # (1.0: reductions._div_t says why)
    akeys = tl.sort(tl.where(fin, _order_key(z, ids_c), KEY_NONE), 0, descending=True)
    n_a = tl.sum(fin.to(tl.int32), 0)
    vals = _key_value(akeys)
    valid = ii < n_a
    m_s = tl.max(tl.where(valid, vals, NEG), 0)
    thr = m_s + log_min_p
    n_s = tl.sum((valid & (vals >= thr)).to(tl.int32), 0)
    v_k = tl.where(n_s >= top_k, tl.sum(tl.where(ii == top_k - 1, vals, 0.0), 0), NEG)
    kk = tl.maximum(thr, v_k)
    # every token >= kk is listed (unlisted ones are <= l_z), or every finite one is
    done = tl.where((n_a == 0) | ((kk <= l_z) & (t > NEG)), 0, 1)
    v_p = NEG
    if top_p < 1.0:
        v_p = _top_p_within(vals, valid & (vals >= kk), m_s, top_p)
    v_star = tl.maximum(kk, v_p)
    tok = _gumbel_max_of(vals, _key_id(akeys), valid & (vals >= v_star), k0, k1)
    return tok, v_star, done


@triton.jit
def _logprobs_from(lval, lid, n, list_on, rk_on, count, v_tok, rank, nlp, mode, T, lse_r, lse_t,
                   l_mv, t, topk_ids, topk_vals, KOUT, S: tl.constexpr):
    """The raw-family logprobs of a row from its ``n <= S`` listed tokens: the sampled
    token's rank counted in the list (``count``: the row asked and the list holds every
    larger value), the top
    ``nlp`` stored (padded to ``KOUT``); returns (rank, ok): not ok when the n-th top value
    could tie with an unlisted token."""
    NEG = float("-inf")
    ok = True
    ii, inl, raw_c, ids_c = _list_of(lval, lid, n, S)
    fin_b = inl & (raw_c > NEG)
    mv_c = _mode_value(tl.where(fin_b, raw_c, 0.0), mode, T, lse_r, lse_t)
    if list_on & count:
        rank = 1 + tl.sum((fin_b & (mv_c > v_tok)).to(tl.int32), 0)
    ids_out = tl.full([S], -1, tl.int64)
    vals_out = tl.full([S], NEG, tl.float32)
    if rk_on:
        bkeys = tl.sort(tl.where(fin_b, _order_key(mv_c, ids_c), KEY_NONE), 0, descending=True)
        n_b = tl.sum(fin_b.to(tl.int32), 0)
        bvals = _key_value(bkeys)
        v_n = tl.where(n_b >= nlp, tl.sum(tl.where(ii == nlp - 1, bvals, 0.0), 0), NEG)
        ok = (v_n > l_mv) | (t == NEG)  # else a tie with an unlisted token is possible
        have = (ii < n_b) & (ii < nlp)
        ids_out = tl.where(have, _key_id(bkeys).to(tl.int64), -1)
        vals_out = tl.where(have, bvals, NEG)
    tl.store(topk_ids + ii, ids_out, mask=ii < KOUT)
    tl.store(topk_vals + ii, vals_out, mask=ii < KOUT)
    return rank, ok


@triton.jit
def _cand_finish_kernel(
    logits_ptr, stride_row, V, W, idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i,
    positions_ptr, pbits_ptr, pmask_ptr, counts_ptr, bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP, words_ptr, wlens_ptr, NW, WL, recent_ptr, RW, ban_ptr,
    part_ptr, part_i_ptr, NCHUNK, KMAX, lval_ptr, lid_ptr, proc_ptr, counter_ptr, tval_ptr,
    tid_ptr, TCAP,
    tok_ptr, lp_ptr, rank_ptr, topk_id_ptr, topk_val_ptr, KOUT, thr_ptr, done_ptr, vtok_ptr,
    rec_ptr,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_TOUCH: tl.constexpr, ANY_LP: tl.constexpr,
    ANY_LIST: tl.constexpr, CAP: tl.constexpr, NCP2: tl.constexpr, NWP2: tl.constexpr,
    WLP2: tl.constexpr, TB: tl.constexpr, SMALL: tl.constexpr, MID: tl.constexpr,
    r_counts_ptr=None, r_pbits_ptr=None, r_tbits_ptr=None, r_recent_ptr=None, R_RW=1,
    RECORD: tl.constexpr = False, R_COUNTS: tl.constexpr = False,
    R_TOUCH: tl.constexpr = False, R_RECENT: tl.constexpr = False, R_RWP2: tl.constexpr = 1,
):
    """Step 2, one program per row (module docstring). ``done``: 1 settled, 2 settled but
    for the rank, 0 left to the fused kernel. RECORD (a launch where every row settles here):
    the row's slot is also advanced by its token (:func:`sampler.kernels.record._record_row`;
    the ``r_*`` tables are the state's)."""
    NEG = float("-inf")
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row)
    if HAS_BAN:
        jw = tl.arange(0, NWP2)
        tl.store(ban_ptr + row * NW + jw,
                 _row_bans(words_ptr, wlens_ptr, NW, WL, recent_ptr, RW, slot, NWP2, WLP2),
                 mask=jw < NW)
    elig, K, greedy, top_k, lp_on, rk_on, nlp, mode = _cand_row(iparams_ptr, stride_i, slot,
                                                                 V, KMAX)
    if not elig:
        tl.store(done_ptr + row, 0)
        return
    ctr = counter_ptr + row * 2
    n_d = tl.load(ctr)
    n_t = tl.load(ctr + 1)
    if (n_d > CAP) | (n_t > TCAP):
        tl.store(done_ptr + row, 0)
        return
    T, rep, freq, pres, row_pen, min_tok_active, _allowed = _row_processing(
        fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr, slot)
    top_p = tl.load(fparams_ptr + slot * stride_f + 1)
    log_min_p = tl.load(fparams_ptr + slot * stride_f + 2)
    # ---------------------------------------------------------------- the chunks combined
    best_v, best_i, m_r, lse_r, lse_t, t = _chunk_partials(part_ptr, part_i_ptr, row, NCHUNK,
                                                           NCP2)  # every unlisted value <= t
    list_on = ANY_LIST & (K > 0)
    l_z = tl.math.div_rn(t, T)  # so no unlisted token has a value / T above l_z
    l_mv = _mode_value(t, mode, T, lse_r, lse_t)  # nor a logprob above l_mv
    # ---------------------------------------------------------------- touched tokens
    lval = lval_ptr + row.to(tl.int64) * CAP
    lid = lid_ptr + row.to(tl.int64) * CAP
    prow = proc_ptr + row.to(tl.int64) * CAP
    n = n_d
    g_v = NEG
    g_i = 2147483647
    if HAS_BAN:
        tl.debug_barrier()  # the bans above are read back by _processed
    if HAS_TOUCH:
        tval = tval_ptr + row.to(tl.int64) * TCAP
        tid = tid_ptr + row.to(tl.int64) * TCAP
        for ts in range(0, n_t, TB):
            jj = ts + tl.arange(0, TB)
            lv = jj < n_t
            raw = tl.load(tval + jj, mask=lv, other=NEG, cache_modifier=".cg")
            ids = tl.load(tid + jj, mask=lv, other=0, cache_modifier=".cg")
            y = _processed(raw, ids, lv, row, slot, V, W, pbits_ptr, pmask_ptr, counts_ptr,
                           rep, freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS,
                           stop_ids_ptr, NSTOP, min_tok_active, ban_ptr, NW, pbits_ptr, False,
                           pbits_ptr, -1, 1, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, False, False)
            y = tl.where(lv, y, NEG)
            if greedy:
                tv = tl.max(y, 0)
                ti = tl.min(tl.where(y == tv, ids, 2147483647), 0)
                upd = (tv > g_v) | ((tv == g_v) & (ti < g_i))
                g_v = tl.where(upd, tv, g_v)
                g_i = tl.where(upd, ti, g_i)
            if list_on:
                rel_a = lv & (y > NEG) & (not greedy)
                rel_a = rel_a & (tl.math.div_rn(tl.where(rel_a, y, 1.0), T) >= l_z)
                rel_b = lv & (raw > NEG) & lp_on
                rel_b = rel_b & (_mode_value(tl.where(rel_b, raw, 1.0), mode, T, lse_r,
                                             lse_t) >= l_mv)
                rel = rel_a | rel_b
                pos = n + tl.cumsum(rel.to(tl.int32), 0) - 1
                put = rel & (pos < CAP)
                tl.store(lval + pos, tl.where(rel_b, raw, NEG), mask=put)
                tl.store(lid + pos, ids, mask=put)
                tl.store(prow + pos, tl.where(rel_a, y, NEG), mask=put)
                n += tl.sum(rel.to(tl.int32), 0)
        tl.debug_barrier()
    if n > CAP:
        tl.store(done_ptr + row, 0)
        return
    # ---------------------------------------------------------------- steps 7-12
    done = 1
    v_star = NEG
    if greedy:
        tok = best_i
        if g_v > best_v:
            tok = g_i
        elif (g_v == best_v) & (g_i < best_i):
            tok = g_i
        if tl.maximum(best_v, g_v) == NEG:
            tok = 0
    else:  # the smallest sort that holds the list (the result does not depend on it)
        seed = tl.load(iparams_ptr + slot * stride_i + 0)
        sidx = tl.load(iparams_ptr + slot * stride_i + 1)
        pos_s = tl.load(positions_ptr + slot)
        k0 = _row_key(seed, sidx, pos_s, tl.full((), LANE0, tl.uint32))
        k1 = _row_key(seed, sidx, pos_s, tl.full((), LANE1, tl.uint32))
        if n <= SMALL:
            tok, v_star, done = _draw_from(lval, lid, prow, n, n_d, T, top_k, top_p, log_min_p,
                                           l_z, t, k0, k1, SMALL)
        elif n <= MID:
            tok, v_star, done = _draw_from(lval, lid, prow, n, n_d, T, top_k, top_p, log_min_p,
                                           l_z, t, k0, k1, MID)
        else:
            tok, v_star, done = _draw_from(lval, lid, prow, n, n_d, T, top_k, top_p, log_min_p,
                                           l_z, t, k0, k1, CAP)
    if done == 0:
        tl.store(done_ptr + row, 0)
        return
    # ---------------------------------------------------------------- logprobs (raw family)
    if ANY_LP:
        raw_tok, v_tok, rank = _sampled_value(logits_ptr + row.to(tl.int64) * stride_row, tok,
                                              lp_on, mode, T, lse_r, lse_t)
        if lp_on & (raw_tok < m_r):
            if not (list_on & (v_tok >= l_mv)):  # a larger value may be unlisted
                done = 2
        topk_ids = topk_id_ptr + row * KOUT
        topk_vals = topk_val_ptr + row * KOUT
        count = lp_on & (done == 1)  # the rank counted in the list
        if n <= SMALL:
            rank, ok = _logprobs_from(lval, lid, n, list_on, rk_on, count, v_tok, rank, nlp,
                                      mode, T, lse_r, lse_t, l_mv, t, topk_ids, topk_vals,
                                      KOUT, SMALL)
        elif n <= MID:
            rank, ok = _logprobs_from(lval, lid, n, list_on, rk_on, count, v_tok, rank, nlp,
                                      mode, T, lse_r, lse_t, l_mv, t, topk_ids, topk_vals,
                                      KOUT, MID)
        else:
            rank, ok = _logprobs_from(lval, lid, n, list_on, rk_on, count, v_tok, rank, nlp,
                                      mode, T, lse_r, lse_t, l_mv, t, topk_ids, topk_vals,
                                      KOUT, CAP)
        if not ok:
            tl.store(done_ptr + row, 0)
            return
        tl.store(lp_ptr + row, v_tok)
        tl.store(vtok_ptr + row, v_tok)
        tl.store(rank_ptr + row, rank.to(tl.int64))
        rec = rec_ptr + row * REC_WIDTH
        tl.store(rec + REC_LSE_R, lse_r)
        tl.store(rec + REC_LSE_T, lse_t)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(thr_ptr + row, v_star)
    tl.store(done_ptr + row, done)
    if RECORD:
        _record_row(slot, tok.to(tl.int64), positions_ptr, r_counts_ptr, r_pbits_ptr,
                    r_tbits_ptr, fparams_ptr, stride_f, r_recent_ptr, V, W, R_RW,
                    R_COUNTS, R_TOUCH, R_RECENT, R_RWP2)
