"""The candidate path: a step for greedy rows and top-k rows in one read of the logits.

``_cand_stats_kernel`` (rows x vocab chunks) reads each chunk once and lists the tokens that can
matter (the untouched ones at or above the chunk's K-th largest lane maximum, and the touched
ones); ``_cand_finish_kernel`` (one program per row) processes the touched tokens, sorts the
list and does steps 7-12 and the logprobs on it with the fused kernel's arithmetic. A row whose
list may miss a token that matters is flagged ``done = 0`` and left to the fused kernel;
``done = 2``: settled but for its rank (:mod:`sampler.kernels.rank`). Why the list suffices:
docs/sampler_kernels.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.kernel_config import REC_LSE_R, REC_LSE_T, REC_WIDTH
from sampler.kernels.draw import _gumbel_max_of
from sampler.kernels.noise import LANE0, LANE1, _row_key
from sampler.kernels.process import _processed, _row_flags, _row_processing
from sampler.kernels.record import _record_row
from sampler.kernels.reductions import (_best, _kth_largest, _lse, _lse_pair, _mode_value,
                                        _online_lse, _token_value)
from sampler.kernels.select import _key_id, _key_value, _order_key, _top_p_within
from sampler.kernels.tiles import _first_tiles, _next_tile
from sampler.ops.bad_words import PAD_ANY

KEY_NONE: tl.constexpr = tl.constexpr(-9223372036854775807 - 1)  # below every value's key
PAD: tl.constexpr = tl.constexpr(PAD_ANY)
# per-chunk partials (float32 fields)
PART_WIDTH: tl.constexpr = tl.constexpr(8)
P_BEST: tl.constexpr = tl.constexpr(0)  # greedy value: max over untouched tokens
P_MR: tl.constexpr = tl.constexpr(1)  # raw log-sum-exp pair
P_LR: tl.constexpr = tl.constexpr(2)
P_MT: tl.constexpr = tl.constexpr(3)  # temperature log-sum-exp pair
P_LT: tl.constexpr = tl.constexpr(4)
P_BOUND: tl.constexpr = tl.constexpr(5)  # u_c, the largest untouched value not listed


@triton.jit
def _cand_row(iparams_ptr, stride_i, slot, V, KMAX):
    """(eligible, K, greedy, top_k, lp_on, rk_on, nlp, mode) of a row: the candidate path
    takes greedy rows and random rows with top-k, without allowed ids, when K (the larger of
    the row's top-k and its top logprobs) is at most KMAX."""
    greedy, k_on, top_k, lp_on, rk_on, nlp, mode = _row_flags(iparams_ptr, stride_i, slot, V)
    allowed = tl.load(iparams_ptr + slot * stride_i + 7) != 0
    K = tl.where(greedy, 0, top_k)
    K = tl.where(rk_on, tl.maximum(K, nlp), K)
    elig = (not allowed) & (greedy | k_on) & (K <= KMAX)
    return elig, K, greedy, top_k, lp_on, rk_on, nlp, mode


@triton.jit
def _touched(trow, first, offs, V):
    """The touch bits of a ``[R, VEC]`` tile: lane r holds ``VEC`` tokens from ``first[r]``,
    all in one 32-bit word (VEC divides 32 and tiles start on a multiple of 32)."""
    words = tl.load(trow + first // 32, mask=first < V, other=0)
    return ((words[:, None] >> (offs & 31)) & 1) != 0


@triton.jit
def _untouched(raw, trow, first, offs, V, HAS_TOUCH: tl.constexpr):
    """Raw values with the touched tokens at -inf (the untouched tokens' processed values)."""
    if HAS_TOUCH:
        return tl.where(_touched(trow, first, offs, V), float("-inf"), raw)
    return raw


@triton.jit
def _put(vals_ptr, ids_ptr, counter, sel, vals, ids, CAP):
    """Appends ``(vals, ids)[sel]`` of a ``[R, VEC]`` tile to a list (two arrays) through an
    atomic counter: one atomic a tile row, positions within the row by a prefix sum (the
    order of the entries is arbitrary; readers sort them, in a later kernel: the atomics
    need no ordering). The counter ends at the number
    of entries asked for, which may exceed ``CAP`` (those beyond are dropped)."""
    sel_i = sel.to(tl.int32)
    cnt = tl.sum(sel_i, 1)
    base = tl.atomic_add(counter + tl.zeros_like(cnt), cnt, mask=cnt > 0, sem="relaxed")
    pos = base[:, None] + tl.cumsum(sel_i, 1) - sel_i
    put = sel & (pos < CAP)
    tl.store(vals_ptr + pos, vals, mask=put)
    tl.store(ids_ptr + pos, ids, mask=put)


@triton.jit
def _cand_stats_kernel(
    logits_ptr, stride_row, V, W, idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i,
    tbits_ptr, part_ptr, part_i_ptr, NCHUNK, CHUNK, KMAX,
    lval_ptr, lid_ptr, counter_ptr, tval_ptr, tid_ptr, CAP, TCAP, scratch_ptr,
    HAS_TOUCH: tl.constexpr, ANY_LP: tl.constexpr, ANY_LIST: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr, CG: tl.constexpr,
    CELLCAP: tl.constexpr, CW: tl.constexpr, GW: tl.constexpr,
    arrive_ptr=None, positions_ptr=None, tok_ptr=None, lp_ptr=None, rank_ptr=None,
    thr_ptr=None, FINISH: tl.constexpr = False, NCP2: tl.constexpr = 1,
    r_counts_ptr=None, r_pbits_ptr=None, r_tbits_ptr=None, r_recent_ptr=None, R_RW=1,
    RECORD: tl.constexpr = False, R_COUNTS: tl.constexpr = False,
    R_TOUCH: tl.constexpr = False, R_RECENT: tl.constexpr = False, R_RWP2: tl.constexpr = 1,
):
    """Step 1, grid rows x chunks (module docstring). The chunk is read once; what the lists
    need beyond the statistics is found from per-cell maxima kept in registers (a cell: one
    lane's ``VEC`` tokens in ``CG`` consecutive tiles, so lane r of tile j is in cell
    ``(r, j // CG)``; ``CG`` a power of two, ``CG * VEC`` tiles a chunk at most): the cells
    whose maximum reaches ``t_c`` are compacted into ``scratch`` and only their tokens are
    read again (from L2). Touched tokens are found from the chunk's nonzero touch words,
    compacted the same way.

    FINISH (a step of greedy rows of unprocessed logits without top logprobs): the last of a
    row's chunk programs to finish (``arrive_ptr``: per row, how many have) combines the
    row's partials and writes its token, logprob and rank (1), and with RECORD advances its
    slot, so the step is this one launch."""
    NEG = float("-inf")
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(idx_ptr + row)
    elig, K, greedy, _tk, lp_on, _rk, _nlp, mode = _cand_row(iparams_ptr, stride_i, slot, V,
                                                              KMAX)
    if not elig:
        return
    T = tl.load(fparams_ptr + slot * stride_f + 0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    trow = tbits_ptr + slot.to(tl.int64) * W
    ctr = counter_ptr + row * 2
    scr = scratch_ptr + (row * NCHUNK + c).to(tl.int64) * (CELLCAP + CW)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    lane = tl.arange(0, R)
    col = tl.arange(0, VEC)
    acc_bv = tl.full([R], NEG, tl.float32)  # per-lane max of the untouched values
    acc_bs = tl.zeros([R], dtype=tl.int32) + lo  # start of the tile where it was reached
    acc_cell = tl.full([R, VEC], NEG, tl.float32)  # per-cell max of the untouched values
    acc_mr = tl.full([R], NEG, tl.float32)
    acc_lr = tl.zeros([R], dtype=tl.float32)
    acc_mt = tl.full([R], NEG, tl.float32)
    acc_lt = tl.zeros([R], dtype=tl.float32)
    pre, pre2 = _first_tiles(base, lo, hi, R, VEC, PREFETCH)
    for start in range(lo, hi, BLOCK):
        cur, pre, pre2 = _next_tile(base, start, hi, pre, pre2, R, VEC, PREFETCH)
        first = start + lane * VEC
        offs = first[:, None] + col[None, :]
        raw = cur.to(tl.float32)  # -inf past hi
        y = _untouched(raw, trow, first, offs, V, HAS_TOUCH)
        tv = tl.max(y, 1)
        upd = tv > acc_bv
        acc_bv = tl.where(upd, tv, acc_bv)
        acc_bs = tl.where(upd, start, acc_bs)
        if ANY_LIST:
            g = (start - lo) // (BLOCK * CG)
            acc_cell = tl.where(col[None, :] == g, tl.maximum(acc_cell, tv[:, None]), acc_cell)
        if ANY_LP:
            if lp_on:
                acc_mr, acc_lr = _online_lse(raw, acc_mr, acc_lr)
                if mode == 4:
                    acc_mt, acc_lt = _online_lse(tl.math.div_rn(raw, T), acc_mt, acc_lt)
    bv = tl.max(acc_bv, 0)
    bi = lo
    if greedy:  # the lowest index of the maximum: each lane's best tile once more
        first = acc_bs + lane * VEC
        offs = first[:, None] + col[None, :]
        raw = tl.load(base + offs, mask=offs < hi, other=NEG).to(tl.float32)
        y = _untouched(raw, trow, first, offs, V, HAS_TOUCH)
        j = tl.min(tl.where(y == acc_bv[:, None], col[None, :], VEC - 1), 1)
        best_v, best_i = _best(acc_bv, first + j)
        bi = tl.where(best_v > NEG, best_i, lo)
    u_c = NEG  # the largest untouched value left out of the list
    n_cell = 0
    t_c = NEG
    list_on = False
    if ANY_LIST:
        if K > 0:
            list_on = True
            t_c = _kth_largest(acc_bv, K)
            # the cells that can hold a token >= t_c, in lane-major order into the scratch
            csel = (acc_cell >= t_c) & (acc_cell > NEG)
            u_c = tl.max(tl.max(tl.where(csel, NEG, acc_cell), 1), 0)
            ci = csel.to(tl.int32)
            per_lane = tl.sum(ci, 1)
            pos = (tl.cumsum(per_lane, 0) - per_lane)[:, None] + tl.cumsum(ci, 1) - ci
            n_cell = tl.sum(per_lane, 0)
            cstart = lo + col[None, :] * (CG * BLOCK) + lane[:, None] * VEC
            tl.store(scr + pos, cstart, mask=csel & (pos < CELLCAP))
    n_word = 0
    if HAS_TOUCH:  # the chunk's nonzero touch words, compacted after the cells
        wi = tl.arange(0, CW)
        w0 = lo // 32
        wv = tl.load(trow + w0 + wi, mask=wi < (hi - lo + 31) // 32, other=0)
        nz = (wv != 0).to(tl.int32)
        n_word = tl.sum(nz, 0)
        tl.store(scr + CELLCAP + tl.cumsum(nz, 0) - nz, w0 + wi, mask=nz != 0)
    if list_on | HAS_TOUCH:
        tl.debug_barrier()  # the scratch written above is read by other threads below
    if list_on:
        if n_cell > CELLCAP:  # too many cells: the row's list is marked overflowing
            tl.atomic_add(ctr, CAP + 1, sem="relaxed")
        else:
            lval = lval_ptr + row.to(tl.int64) * CAP
            lid = lid_ptr + row.to(tl.int64) * CAP
            # R lane-rows of VEC tokens at a time, as in a tile: row i is tile i % CG of
            # cell i // CG
            for rb in range(0, n_cell * CG, R):
                ri = rb + lane
                live = ri < n_cell * CG
                first = tl.load(scr + ri // CG, mask=live, other=0) + (ri % CG) * BLOCK
                offs = first[:, None] + col[None, :]
                raw = tl.load(base + offs, mask=live[:, None] & (offs < hi),
                              other=NEG).to(tl.float32)
                y = _untouched(raw, trow, first, offs, V, HAS_TOUCH)
                sel = (y >= t_c) & (y > NEG)
                _put(lval, lid, ctr, sel, raw, offs, CAP)
                u_c = tl.maximum(u_c, tl.max(tl.max(tl.where(sel, NEG, y), 1), 0))
    if HAS_TOUCH:  # every touched token of the chunk into the touched list
        tval = tval_ptr + row.to(tl.int64) * TCAP
        tid = tid_ptr + row.to(tl.int64) * TCAP
        b = tl.arange(0, 32)
        for gs in range(0, n_word, GW):
            gi = gs + tl.arange(0, GW)
            gm = gi < n_word
            wid = tl.load(scr + CELLCAP + gi, mask=gm, other=0)
            bits = tl.load(trow + wid, mask=gm, other=0)
            toks = wid[:, None] * 32 + b[None, :]
            on = (((bits[:, None] >> b[None, :]) & 1) != 0) & gm[:, None] & (toks < hi)
            raw = tl.load(base + toks, mask=on, other=NEG).to(tl.float32)
            _put(tval, tid, ctr + 1, on & (raw > NEG), raw, toks, TCAP)
    mr, lr = _lse_pair(acc_mr, acc_lr)
    mt, lt = _lse_pair(acc_mt, acc_lt)
    out = part_ptr + (row * NCHUNK + c) * PART_WIDTH
    tl.store(out + P_BEST, bv)
    tl.store(out + P_MR, mr)
    tl.store(out + P_LR, lr)
    tl.store(out + P_MT, mt)
    tl.store(out + P_LT, lt)
    tl.store(out + P_BOUND, u_c)
    tl.store(part_i_ptr + row * NCHUNK + c, bi)
    if FINISH:
        tl.debug_barrier()  # every thread's stores before the release below
        if tl.atomic_add(arrive_ptr + row, 1, sem="acq_rel") == NCHUNK - 1:
            tl.store(arrive_ptr + row, 0)  # for the next step
            _greedy_finish(logits_ptr, stride_row, row, slot, V, W, fparams_ptr, stride_f, T,
                           lp_on, mode, part_ptr, part_i_ptr, NCHUNK, positions_ptr, tok_ptr,
                           lp_ptr, rank_ptr, thr_ptr, r_counts_ptr, r_pbits_ptr, r_tbits_ptr,
                           r_recent_ptr, R_RW, ANY_LP, NCP2, RECORD, R_COUNTS, R_TOUCH,
                           R_RECENT, R_RWP2)


@triton.jit
def _chunk_partials(part_ptr, part_i_ptr, row, NCHUNK, NCP2: tl.constexpr):
    """A row's chunk partials combined: (greedy value, its lowest index, raw maximum, raw and
    temperature log-sum-exps, largest unlisted value). Read from L2 (``.cg``): other
    programs, or the kernel before, wrote them."""
    NEG = float("-inf")
    jc = tl.arange(0, NCP2)
    live = jc < NCHUNK
    pf = part_ptr + (row * NCHUNK + jc) * PART_WIDTH
    best_v, best_i = _best(tl.load(pf + P_BEST, mask=live, other=NEG, cache_modifier=".cg"),
                           tl.load(part_i_ptr + row * NCHUNK + jc, mask=live, other=0,
                                   cache_modifier=".cg"))
    acc_mr = tl.load(pf + P_MR, mask=live, other=NEG, cache_modifier=".cg")
    lse_r = _lse(acc_mr, tl.load(pf + P_LR, mask=live, other=0.0, cache_modifier=".cg"))
    lse_t = _lse(tl.load(pf + P_MT, mask=live, other=NEG, cache_modifier=".cg"),
                 tl.load(pf + P_LT, mask=live, other=0.0, cache_modifier=".cg"))
    t = tl.max(tl.load(pf + P_BOUND, mask=live, other=NEG, cache_modifier=".cg"), 0)
    return best_v, best_i, tl.max(acc_mr, 0), lse_r, lse_t, t


@triton.jit
def _greedy_finish(logits_ptr, stride_row, row, slot, V, W, fparams_ptr, stride_f, T, lp_on,
                   mode, part_ptr, part_i_ptr, NCHUNK, positions_ptr, tok_ptr, lp_ptr, rank_ptr,
                   thr_ptr, r_counts_ptr, r_pbits_ptr, r_tbits_ptr, r_recent_ptr, R_RW,
                   ANY_LP: tl.constexpr, NCP2: tl.constexpr, RECORD: tl.constexpr,
                   R_COUNTS: tl.constexpr, R_TOUCH: tl.constexpr, R_RECENT: tl.constexpr,
                   R_RWP2: tl.constexpr):
    """A greedy row of unprocessed logits from its chunks' partials (read from L2: other
    programs wrote them): the raw maximum's lowest index, its raw-family logprob, rank 1."""
    NEG = float("-inf")
    best_v, best_i, _m_r, lse_r, lse_t, _t = _chunk_partials(part_ptr, part_i_ptr, row,
                                                             NCHUNK, NCP2)
    tok = tl.where(best_v > NEG, best_i, 0)
    if ANY_LP:
        v_tok = float("nan")
        rank = 0
        if lp_on:
            _raw_tok, v_tok = _token_value(logits_ptr + row.to(tl.int64) * stride_row, tok,
                                          mode, T, lse_r, lse_t)
            rank = 1
        tl.store(lp_ptr + row, v_tok)
        tl.store(rank_ptr + row, rank.to(tl.int64))
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(thr_ptr + row, NEG)
    if RECORD:
        _record_row(slot, tok.to(tl.int64), positions_ptr, r_counts_ptr, r_pbits_ptr,
                    r_tbits_ptr, fparams_ptr, stride_f, r_recent_ptr, V, W, R_RW,
                    R_COUNTS, R_TOUCH, R_RECENT, R_RWP2)


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
    z = tl.math.div_rn(tl.where(fin, proc, 0.0), T)
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
                rel_a = rel_a & (tl.math.div_rn(tl.where(rel_a, y, 0.0), T) >= l_z)
                rel_b = lv & (raw > NEG) & lp_on
                rel_b = rel_b & (_mode_value(tl.where(rel_b, raw, 0.0), mode, T, lse_r,
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
        v_tok = float("nan")
        rank = 0
        if lp_on:
            raw_tok, v_tok = _token_value(logits_ptr + row.to(tl.int64) * stride_row, tok,
                                          mode, T, lse_r, lse_t)
            rank = 1
            if raw_tok < m_r:
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
