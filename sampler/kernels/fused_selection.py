"""The selection step of the fused kernel: top-k / top-p thresholds and the top-k logprobs
list by histogram passes over a row (:mod:`sampler.kernels.select`), no sort of the row.

Two state machines share each pass. P (processed / T): phases 0 top-k refine, 1 top-k gather,
2 top-p refine, 3 top-p gather, 4 done. R (raw values, the top-k logprobs): 0 refine,
1 gather, 2 done. A refine pass narrows the bin holding the boundary; a gather pass appends
the tokens at or above it to a list of at most ``CAP`` and sorts it exactly
(docs/sampler_kernels.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.reductions import _div_t, _exp, _kth_largest, _mode_value
from sampler.kernels.select import (_append, _bin_of, _choose_bin, _count_bins, _key_value,
                                    _mass_bins, _next_up, _next_width, _order_key, _read_cands,
                                    _top_p_within)
from sampler.kernels.tiles import _first_tiles, _next_tile, _tile_of


@triton.jit
def _selection_pass(
    base, row, slot, V, W, T, m_s, m_r, lse_r, lse_t, mode,
    p_phase, p_mass, p_floor, p_lo, p_w, p_hi, p_all, p_t0, cand_p, ctr_p,
    r_phase, r_lo, r_w, r_hi, r_t0, cand_r, ctr_r,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ANY_LP: tl.constexpr, ANY_MASS: tl.constexpr, HIST: tl.constexpr, BLOCK: tl.constexpr,
    NP: tl.constexpr, CAP: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One pass over a row for both state machines: in a refine phase the bin counts (and
    top-p masses) of the processed values below ``m_s`` / of the raw values below ``m_r``;
    in a gather phase the boundary bin's tokens appended to the candidate list. Returns
    (counts, masses, raw counts, the least processed value above the boundary bin)."""
    NEG = float("-inf")
    jj = tl.arange(0, NP)
    cnt_p = tl.zeros([NP], dtype=tl.int32)
    mss_p = tl.zeros([NP], dtype=tl.float32)
    cnt_r = tl.zeros([NP], dtype=tl.int32)
    acc_above = tl.full([R], float("inf"), tl.float32)  # min value above the bin
    pre, pre2 = _first_tiles(base, 0, V, R, VEC, PREFETCH)
    for start in range(0, V, BLOCK):
        cur, pre, pre2 = _next_tile(base, start, V, pre, pre2, R, VEC, PREFETCH)
        offs, vmask, raw, x = _tile_of(
            cur, start, row, slot, V, W, V, pbits_ptr, pmask_ptr, counts_ptr, rep,
            freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr,
            NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED, HAS_GRAMMAR)
        if p_phase < 4:
            s = _div_t(x, T)
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
    return cnt_p, mss_p, cnt_r, acc_above


@triton.jit
def _select(
    base, row, slot, V, W, T, thr, m_s, m_r, lse_r, lse_t, top_k, top_p, greedy, fast_done,
    lp_on, nlp, mode, acc_ms, acc_mr, cand_p, cand_r, ctr_p, ctr_r,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    R: tl.constexpr, VEC: tl.constexpr, HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_STOP: tl.constexpr, HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_GRAMMAR: tl.constexpr,
    ANY_LP: tl.constexpr, ANY_MASS: tl.constexpr, HIST: tl.constexpr, BLOCK: tl.constexpr,
    NP: tl.constexpr, CAP: tl.constexpr, MAX_PASSES: tl.constexpr, W0: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The selection step of a row: the top-k value ``v_k`` and top-p boundary ``v_p`` (P
    machine, over processed / T) and the raw top-n list of the top-k logprobs (R machine).
    Returns (v_k, v_p, from_cands: the kept set is in the candidate list, its length p_n,
    the raw list's length r_n, its bound r_hi below m_r, sel_on, rk_on, r_t0: the raw
    list's lower bound)."""
    NEG = float("-inf")
    v_k = NEG
    v_p = NEG
    from_cands = False
    p_n = 0
    r_n = 0
    r_hi = float("inf")
    r_t0 = NEG
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
        if (p_phase == 1) | (p_phase == 3):
            tl.store(ctr_p, 0)
        if r_phase == 1:
            tl.store(ctr_r, 0)
        tl.debug_barrier()
        cnt_p, mss_p, cnt_r, acc_above = _selection_pass(
            base, row, slot, V, W, T, m_s, m_r, lse_r, lse_t, mode,
            p_phase, p_mass, p_floor, p_lo, p_w, p_hi, p_all, p_t0, cand_p, ctr_p,
            r_phase, r_lo, r_w, r_hi, r_t0, cand_r, ctr_r,
            pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
            bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, min_tok_active,
            ban_ptr, NBAN, allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
            R, VEC, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN, HAS_ALLOWED,
            HAS_GRAMMAR, ANY_LP, ANY_MASS,
            HIST, BLOCK, NP, CAP, PREFETCH)
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
    return v_k, v_p, from_cands, p_n, r_n, r_hi, sel_on, rk_on, r_t0
