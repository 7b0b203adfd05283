"""The chunked sampling pipeline: several programs per row, each over a vocab chunk.

The fused kernel (:mod:`sampler.kernels.fused`) runs one program per row, so a pass over a
row is as fast as one SM streams it. Here the passes that read the whole row run on a grid of
rows x vocab chunks, and the per-row work in between runs on small per-row programs:

1. statistics, per chunk (``_stats_kernel`` with ``LANES``): greedy (value, index), max of
   x / T, the (max, sum) pairs of the raw and temperature log-sum-exps, and the chunk's ``KM``
   largest per-lane maxima of x / T and of the raw values;
2. bounds, per row: the chunks combined (max, greedy token, log-sum-exps); the top-k bound
   ``t_k``, the k-th largest of the stored lane maxima (k distinct tokens are ``>= t_k``, so
   the k-th largest value is too), and the same bound ``t_r`` for the top-k logprobs;
3. gather, per chunk: the survivors ``>= max(t_k, min-p threshold)`` and the raw values
   ``>= t_r`` appended to per-row candidate lists (atomics);
3b. for the random rows without top-k, draw first, then verify (the fused kernel's fast
   path, over chunks): the Gumbel-max over the min-p survivors and their mass; then rounds
   of one pass each that count the survivors above the current draw and their mass (top-p
   keeps the draw iff there are none or their mass is < p of all) and draw the next one
   among them; a row still undecided after the last round is left to the fused kernel;
4. finish, per row: the candidate lists sorted exactly, top-k, top-p within it, the
   Gumbel-max draw over the kept candidates, the sampled token's logprob, its rank when the
   raw list holds every larger value, the top-k logprobs;
5. rank, per chunk: the tokens above the sampled one counted, for the rows whose rank the
   list could not give.

The arithmetic of each value is the fused kernel's (the same tile functions, keys, noise
and top-p prefix sum), so a row gets the fused kernel's token; the log-sum-exps are summed in
chunk order, so logprobs may differ from the fused kernel's in the last bits (and the top-p
mass of a draw-then-verify row too, which could flip a decision within float rounding of p).
Rows this path does not settle (more candidates than the list holds, a draw still undecided
after the last round) are flagged, and the fused kernel, launched after it with those flags,
runs them alone. Which path a row takes depends
on the row alone (its parameters and logits), never on its batch-mates.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.token_bitmask import _mask_row

from sampler.kernels.fused import (_append, _best, _gumbel_max_of, _kth_largest, _load_tile,
                                   _lse, _mode_value, _read_cands, _scan, _tile_of,
                                   _token_value, _top_p_within)
from sampler.kernels.process import _row_processing
from sampler.kernels.noise import LANE0, LANE1, _row_key
from sampler.kernels.select import _key_id, _key_value, _order_key

# per-row record written by the bounds kernel (float32 fields): max of x / T, raw max, the
# two log-sum-exps, the min-p threshold, the top-k and top-k-logprobs bounds
REC_WIDTH: tl.constexpr = tl.constexpr(8)
REC_M_S: tl.constexpr = tl.constexpr(0)
REC_M_R: tl.constexpr = tl.constexpr(1)
REC_LSE_R: tl.constexpr = tl.constexpr(2)
REC_LSE_T: tl.constexpr = tl.constexpr(3)
REC_THR: tl.constexpr = tl.constexpr(4)
REC_T_K: tl.constexpr = tl.constexpr(5)
REC_T_R: tl.constexpr = tl.constexpr(6)
# draw-then-verify state of a row (random, no top-k)
DRAW_ACTIVE: tl.constexpr = tl.constexpr(1)
DRAW_SETTLED: tl.constexpr = tl.constexpr(2)
DRAW_FAILED: tl.constexpr = tl.constexpr(3)


@triton.jit
def _row_flags(iparams_ptr, stride_i, slot, V):
    """(greedy, k_on, top_k, lp_on, rk_on, nlp, mode) of a row."""
    top_k = tl.load(iparams_ptr + slot * stride_i + 2)
    nlp = tl.load(iparams_ptr + slot * stride_i + 4)
    mode = tl.load(iparams_ptr + slot * stride_i + 5)
    greedy = tl.load(iparams_ptr + slot * stride_i + 6) != 0
    raw_family = (mode == 0) | (mode == 1) | (mode == 4)
    lp_on = (nlp != -2) & raw_family & (nlp >= 0)
    k_on = (top_k > 0) & (top_k < V)
    return greedy, k_on, top_k, lp_on, lp_on & (nlp > 0), nlp, mode


@triton.jit
def _chunk_bounds_kernel(
    part_ptr, part_i_ptr, lanes_ptr, NCHUNK, KM, rec_ptr, best_ptr,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, V,
    NCP2: tl.constexpr, NL: tl.constexpr,
):
    """Step 2, one program per row."""
    NEG = float("-inf")
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row)
    log_min_p = tl.load(fparams_ptr + slot * stride_f + 2)
    greedy, k_on, top_k, lp_on, rk_on, nlp, mode = _row_flags(iparams_ptr, stride_i, slot, V)
    jc = tl.arange(0, NCP2)
    live = jc < NCHUNK
    pf = part_ptr + (row * NCHUNK + jc) * 8
    best_v, best_i = _best(tl.load(pf + 0, mask=live, other=NEG),
                           tl.load(part_i_ptr + row * NCHUNK + jc, mask=live, other=0))
    acc_ms = tl.load(pf + 1, mask=live, other=NEG)
    acc_mr = tl.load(pf + 2, mask=live, other=NEG)
    acc_lr = tl.load(pf + 3, mask=live, other=0.0)
    acc_mt = tl.load(pf + 4, mask=live, other=NEG)
    acc_lt = tl.load(pf + 5, mask=live, other=0.0)
    m_s = tl.max(acc_ms, 0)
    jl = tl.arange(0, NL)
    lv = jl < NCHUNK * KM
    lanes = lanes_ptr + row.to(tl.int64) * NCHUNK * 2 * KM + (jl // KM) * (2 * KM) + jl % KM
    t_k = NEG
    if (not greedy) & k_on:
        t_k = _kth_largest(tl.load(lanes, mask=lv, other=NEG), top_k)
    t_r = NEG
    if rk_on:
        t_r = _kth_largest(tl.load(lanes + KM, mask=lv, other=NEG), nlp)
    rec = rec_ptr + row * REC_WIDTH
    tl.store(rec + REC_M_S, m_s)
    tl.store(rec + REC_M_R, tl.max(acc_mr, 0))
    tl.store(rec + REC_LSE_R, _lse(acc_mr, acc_lr))
    tl.store(rec + REC_LSE_T, _lse(acc_mt, acc_lt))
    tl.store(rec + REC_THR, m_s + log_min_p)
    tl.store(rec + REC_T_K, t_k)
    tl.store(rec + REC_T_R, t_r)
    tl.store(best_ptr + row, best_i)


@triton.jit
def _chunk_gather_kernel(
    logits_ptr, stride_row, V, W,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr,
    pbits_ptr, pmask_ptr, counts_ptr, bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP, ban_ptr, NBAN, allowed_ptr, gbits_ptr, grow_ptr, GW,
    rec_ptr, cand_ptr, counter_ptr, CHUNK,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
    ANY_RANDOM: tl.constexpr,
    ANY_RK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, CAP: tl.constexpr,
):
    """Step 3, grid rows x chunks."""
    NEG = float("-inf")
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(idx_ptr + row)
    greedy, k_on, top_k, lp_on, rk_on, nlp, mode = _row_flags(iparams_ptr, stride_i, slot, V)
    sel_on = (not greedy) & k_on
    if not ANY_RANDOM:
        sel_on = False
    if not ANY_RK:
        rk_on = False
    if not (sel_on | rk_on):
        return
    T, rep, freq, pres, row_pen, min_tok_active, row_allowed = _row_processing(
        fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr, slot)
    mrow = _mask_row(grow_ptr, row, HAS_GRAMMAR)
    rec = rec_ptr + row * REC_WIDTH
    floor = tl.maximum(tl.load(rec + REC_THR), tl.load(rec + REC_T_K))
    t_r = tl.load(rec + REC_T_R)
    lse_r = tl.load(rec + REC_LSE_R)
    lse_t = tl.load(rec + REC_LSE_T)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cand_p = cand_ptr + row.to(tl.int64) * (2 * CAP)
    ctr = counter_ptr + row * 2
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs, vmask, raw, x = _tile_of(
            _load_tile(base, start, hi, R, VEC), start, row, slot, V, W, hi, pbits_ptr,
            pmask_ptr, counts_ptr, rep, freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr,
            NBIAS, stop_ids_ptr, NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed,
            gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
        if ANY_RANDOM:
            if sel_on:
                s = tl.math.div_rn(x, T)
                sel = (s >= floor) & (s > NEG)
                _append(cand_p, ctr, sel, _order_key(s, offs), CAP)
        if ANY_RK:
            if rk_on:
                sel_r = (raw >= t_r) & (raw > NEG)
                mv = _mode_value(raw, mode, T, lse_r, lse_t)
                _append(cand_p + CAP, ctr + 1, sel_r, _order_key(mv, offs), CAP)


@triton.jit
def _chunk_finish_kernel(
    logits_ptr, stride_row, V,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr,
    rec_ptr, best_ptr, cand_ptr, counter_ptr, draw_ptr, draw_i_ptr,
    tok_ptr, lp_ptr, rank_ptr, topk_id_ptr, topk_val_ptr, KOUT, thr_ptr, done_ptr, vtok_ptr,
    ANY_LP: tl.constexpr, ANY_RANDOM: tl.constexpr, ANY_RK: tl.constexpr, CAP: tl.constexpr,
    DRAW: tl.constexpr,
):
    """Step 4, one program per row. ``done``: 1 settled, 2 settled but for the rank (step 5
    counts it), 0 left to the fused kernel."""
    NEG = float("-inf")
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row)
    greedy, k_on, top_k, lp_on, rk_on, nlp, mode = _row_flags(iparams_ptr, stride_i, slot, V)
    if not ANY_RK:
        rk_on = False
    T = tl.load(fparams_ptr + slot * stride_f + 0)
    top_p = tl.load(fparams_ptr + slot * stride_f + 1)
    rec = rec_ptr + row * REC_WIDTH
    m_s = tl.load(rec + REC_M_S)
    m_r = tl.load(rec + REC_M_R)
    lse_r = tl.load(rec + REC_LSE_R)
    lse_t = tl.load(rec + REC_LSE_T)
    thr = tl.load(rec + REC_THR)
    t_r = tl.load(rec + REC_T_R)
    cand_p = cand_ptr + row.to(tl.int64) * (2 * CAP)
    cand_r = cand_p + CAP
    n_p = tl.load(counter_ptr + row * 2)
    n_r = tl.load(counter_ptr + row * 2 + 1)
    settled = (not rk_on) | (n_r <= CAP)
    ii = tl.arange(0, CAP)
    tok = tl.load(best_ptr + row)
    v_star = NEG
    if ANY_RANDOM:
        if (not greedy) & (not k_on):
            if DRAW:  # the draw-then-verify rounds' token, when they settled it
                settled = settled & (tl.load(draw_i_ptr + row * 2 + 1) == DRAW_SETTLED)
                tok = tl.load(draw_i_ptr + row * 2)
                v_star = thr
            else:
                settled = False
        if (not greedy) & k_on:
            settled = settled & (n_p <= CAP)
            if settled:
                keys = tl.sort(_read_cands(cand_p, n_p, CAP), 0, descending=True)
                vals = _key_value(keys)
                ids = _key_id(keys)
                inlist = ii < n_p
                # fewer than k survivors were gathered only when all of them were
                v_k = tl.where(n_p >= top_k,
                               tl.sum(tl.where(ii == top_k - 1, vals, 0.0), 0), NEG)
                v_p = NEG
                if top_p < 1.0:
                    v_p = _top_p_within(vals, inlist & (vals >= v_k), m_s, top_p)
                v_star = tl.maximum(thr, tl.maximum(v_k, v_p))
                seed = tl.load(iparams_ptr + slot * stride_i + 0)
                sidx = tl.load(iparams_ptr + slot * stride_i + 1)
                pos = tl.load(positions_ptr + slot)
                k0 = _row_key(seed, sidx, pos, tl.full((), LANE0, tl.uint32))
                k1 = _row_key(seed, sidx, pos, tl.full((), LANE1, tl.uint32))
                tok = _gumbel_max_of(vals, ids, inlist & (vals >= v_star), k0, k1)
    if not settled:
        tl.store(done_ptr + row, 0)
        return
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(thr_ptr + row, v_star)
    done = 1
    if ANY_LP:
        v_tok = float("nan")
        rank = 0
        if lp_on:
            raw_tok, v_tok = _token_value(logits_ptr + row.to(tl.int64) * stride_row, tok,
                                          mode, T, lse_r, lse_t)
            rank = 1
            if raw_tok < m_r:
                if rk_on & (raw_tok >= t_r):  # the raw list holds every larger value
                    keys = tl.load(cand_r + ii, mask=ii < n_r,
                                   other=-9223372036854775807 - 1, cache_modifier=".cg")
                    rank = 1 + tl.sum(((ii < n_r) & (_key_value(keys) > v_tok)).to(tl.int32), 0)
                else:
                    done = 2
        tl.store(lp_ptr + row, v_tok)
        tl.store(vtok_ptr + row, v_tok)
        tl.store(rank_ptr + row, rank.to(tl.int64))
        ids_out = tl.full([CAP], -1, tl.int64)
        vals_out = tl.full([CAP], NEG, tl.float32)
        if rk_on:
            keys = tl.sort(_read_cands(cand_r, n_r, CAP), 0, descending=True)
            have = (ii < n_r) & (ii < nlp)
            ids_out = tl.where(have, _key_id(keys).to(tl.int64), -1)
            vals_out = tl.where(have, _key_value(keys), NEG)
        tl.store(topk_id_ptr + row * KOUT + ii, ids_out, mask=ii < KOUT)
        tl.store(topk_val_ptr + row * KOUT + ii, vals_out, mask=ii < KOUT)
    tl.store(done_ptr + row, done)


@triton.jit
def _chunk_rank_kernel(
    logits_ptr, stride_row, V, idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i,
    rec_ptr, done_ptr, vtok_ptr, rank_ptr, CHUNK, BLOCK: tl.constexpr,
):
    """Step 5, grid rows x chunks: adds the chunk's count of values above the sampled
    token's to the rank of a row flagged 2."""
    row = tl.program_id(0)
    if tl.load(done_ptr + row) != 2:
        return
    c = tl.program_id(1)
    slot = tl.load(idx_ptr + row)
    T = tl.load(fparams_ptr + slot * stride_f + 0)
    mode = tl.load(iparams_ptr + slot * stride_i + 5)
    lse_r = tl.load(rec_ptr + row * REC_WIDTH + REC_LSE_R)
    lse_t = tl.load(rec_ptr + row * REC_WIDTH + REC_LSE_T)
    v_tok = tl.load(vtok_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        raw = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        acc += (_mode_value(raw, mode, T, lse_r, lse_t) > v_tok).to(tl.int32)
    tl.atomic_add(rank_ptr + row, tl.sum(acc, 0).to(tl.int64))



@triton.jit
def _chunk_draw_kernel(
    logits_ptr, stride_row, V, W,
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr,
    pbits_ptr, pmask_ptr, counts_ptr, bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP, ban_ptr, NBAN, allowed_ptr, gbits_ptr, grow_ptr, GW,
    rec_ptr, draw_ptr, draw_i_ptr, dpart_ptr, dpart_i_ptr, NCHUNK, CHUNK,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
    FIRST: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    """One draw-then-verify pass over a chunk (grid rows x chunks) for the random rows
    without top-k, the fused kernel's ``_draw_then_verify`` spread over chunks. FIRST: the
    Gumbel-max over the survivors (processed / T >= the min-p threshold) and the survivors'
    mass; after: the mass and count of the survivors strictly above the current draw ``x``
    (does top-p keep it?) and the Gumbel-max over them (the next draw if not). Per-chunk
    partials: (best score, its value, count above, mass) and the best token."""
    NEG = float("-inf")
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    if tl.load(draw_i_ptr + row * 2 + 1) != DRAW_ACTIVE:
        return
    c = tl.program_id(1)
    slot = tl.load(idx_ptr + row)
    T, rep, freq, pres, row_pen, min_tok_active, row_allowed = _row_processing(
        fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr, slot)
    mrow = _mask_row(grow_ptr, row, HAS_GRAMMAR)
    seed = tl.load(iparams_ptr + slot * stride_i + 0)
    sidx = tl.load(iparams_ptr + slot * stride_i + 1)
    pos = tl.load(positions_ptr + slot)
    k0 = _row_key(seed, sidx, pos, tl.full((), LANE0, tl.uint32))
    k1 = _row_key(seed, sidx, pos, tl.full((), LANE1, tl.uint32))
    m_s = tl.load(rec_ptr + row * REC_WIDTH + REC_M_S)
    thr = tl.load(rec_ptr + row * REC_WIDTH + REC_THR)
    s_x = NEG
    if not FIRST:
        s_x = tl.load(draw_ptr + row * 2)
    lo = c * CHUNK
    # above x (FIRST: above -inf, every survivor): the draw and the count / mass
    tok, s_tok, count, mass, _n, _z, best = _scan(
        logits_ptr + row.to(tl.int64) * stride_row, lo, tl.minimum(lo + CHUNK, V), row, slot,
        V, W, T, thr, m_s, s_x, s_x, k0, k1,
        pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
        bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
        ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
        R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR,
        DRAW=True, COUNT=True, MASS=True, TOTAL=False)
    out = dpart_ptr + (row * NCHUNK + c) * 4
    tl.store(out + 0, best)
    tl.store(out + 1, s_tok)
    tl.store(out + 2, count.to(tl.float32))
    tl.store(out + 3, mass)
    tl.store(dpart_i_ptr + row * NCHUNK + c, tok)


@triton.jit
def _chunk_draw_combine_kernel(
    idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i, V,
    draw_ptr, draw_i_ptr, dpart_ptr, dpart_i_ptr, NCHUNK,
    FIRST: tl.constexpr, LAST: tl.constexpr, NCP2: tl.constexpr,
):
    """Per row after a draw pass: FIRST starts the rows (state ``DRAW_ACTIVE`` set by the
    launcher for every row; rows that are not random without top-k leave), keeps the draw
    and the survivors' mass; later passes settle the current draw when top-p keeps it (no
    survivor above it, or their mass < p of all), else move to the next draw; LAST fails the
    rows still undecided (the fused kernel takes them)."""
    NEG = float("-inf")
    row = tl.program_id(0)
    state = draw_i_ptr + row * 2 + 1
    if tl.load(state) != DRAW_ACTIVE:
        return
    slot = tl.load(idx_ptr + row)
    top_p = tl.load(fparams_ptr + slot * stride_f + 1)
    jc = tl.arange(0, NCP2)
    live = jc < NCHUNK
    pf = dpart_ptr + (row * NCHUNK + jc) * 4
    scores = tl.load(pf + 0, mask=live, other=NEG)
    toks = tl.load(dpart_i_ptr + row * NCHUNK + jc, mask=live, other=2147483647)
    best = tl.max(scores, 0)
    tok = tl.min(tl.where(scores == best, toks, 2147483647), 0)
    s_tok = tl.max(tl.where((scores == best) & (toks == tok),
                            tl.load(pf + 1, mask=live, other=NEG), NEG), 0)
    count = tl.sum(tl.load(pf + 2, mask=live, other=0.0), 0)
    mass = tl.sum(tl.load(pf + 3, mask=live, other=0.0), 0)
    new_state = DRAW_ACTIVE
    if FIRST:
        greedy = tl.load(iparams_ptr + slot * stride_i + 6) != 0
        top_k = tl.load(iparams_ptr + slot * stride_i + 2)
        if greedy | ((top_k > 0) & (top_k < V)):
            new_state = 0  # not this path's row
        elif best == NEG:
            new_state = DRAW_FAILED
        else:
            tl.store(draw_ptr + row * 2 + 1, mass)  # the survivors' mass Z
            tl.store(draw_i_ptr + row * 2, tok)
            tl.store(draw_ptr + row * 2, s_tok)
            if top_p >= 1.0:
                new_state = DRAW_SETTLED
    else:
        z = tl.load(draw_ptr + row * 2 + 1)
        if (count == 0) | (mass < top_p * z):  # top-p keeps the current draw
            new_state = DRAW_SETTLED
        elif best == NEG:
            new_state = DRAW_FAILED
        else:  # the kept set lies strictly above the rejected draw: the next draw
            tl.store(draw_i_ptr + row * 2, tok)
            tl.store(draw_ptr + row * 2, s_tok)
    if LAST:
        if new_state == DRAW_ACTIVE:
            new_state = DRAW_FAILED
    tl.store(state, new_state)
