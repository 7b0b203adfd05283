"""The candidate path's first kernel: a step for greedy rows and top-k rows in one read of the
logits, grid rows x vocab chunks.

``_cand_stats_kernel`` reads each chunk once, writes its statistics (``PART_WIDTH`` float32
fields a chunk) and lists the tokens that can matter: the untouched ones at or above the chunk's
K-th largest lane maximum, and the touched ones. With FINISH a greedy step ends in it
(``_greedy_finish``). :mod:`sampler.kernels.candidate_finish` takes the lists. Why the list
suffices: docs/sampler_kernels.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.process import _row_flags
from sampler.kernels.record import _record_row
from sampler.kernels.reductions import (_best, _kth_largest, _lse, _lse_pair, _online_lse,
                                        _sampled_value)
from sampler.kernels.tiles import _first_tiles, _next_tile
from sampler.kernels.token_bitmask_kernel import _lane_bits

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
def _untouched(raw, trow, first, V, HAS_TOUCH: tl.constexpr, VEC: tl.constexpr):
    """Raw values of a ``[R, VEC]`` tile (lane r: the ``VEC`` tokens from ``first[r]``) with
    the touched tokens at -inf (the untouched tokens' processed values)."""
    if HAS_TOUCH:
        return tl.where(_lane_bits(trow, first, V, VEC), float("-inf"), raw)
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
        raw = cur.to(tl.float32)  # -inf past hi
        y = _untouched(raw, trow, first, V, HAS_TOUCH, VEC)
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
        y = _untouched(raw, trow, first, V, HAS_TOUCH, VEC)
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
                y = _untouched(raw, trow, first, V, HAS_TOUCH, VEC)
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
        _raw_tok, v_tok, rank = _sampled_value(logits_ptr + row.to(tl.int64) * stride_row,
                                               tok, lp_on, mode, T, lse_r, lse_t)
        tl.store(lp_ptr + row, v_tok)
        tl.store(rank_ptr + row, rank.to(tl.int64))
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(thr_ptr + row, NEG)
    if RECORD:
        _record_row(slot, tok.to(tl.int64), positions_ptr, r_counts_ptr, r_pbits_ptr,
                    r_tbits_ptr, fparams_ptr, stride_f, r_recent_ptr, V, W, R_RW,
                    R_COUNTS, R_TOUCH, R_RECENT, R_RWP2)
