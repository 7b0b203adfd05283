"""Threshold search without a sort (top-k, top-p) and candidate lists, in Triton.

A row's values are binned by their distance ``d = max - value`` below the row maximum into
``NP - 1`` bins between fp32 edges ``lo + j * w`` (the last one open up to ``hi``); one pass
fills a histogram of counts (and of probability mass for top-p), the bin holding the k-th
value (or where the cumulative mass reaches p) becomes the next ``[lo, hi)``, and once it
holds at most ``CAP`` values they are gathered into a per-row scratch list and sorted exactly
by (value desc, id asc) keys. Bin membership is computed against the stored edges, so counts
of successive passes agree exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.reductions import _exp


@triton.jit
def _order_key(v, ids):
    """Unique int64 keys: descending value, then ascending id."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64))


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key):
    return (4294967295 - (key & 4294967295)).to(tl.int32)


@triton.jit
def _bin_of(d, lo, w, hi, NP: tl.constexpr):
    """Bin index of d in [lo, hi) with edges E(j) = lo + j * w (j < NP - 1), E(NP - 1) = hi;
    NP - 1 (the junk bin) outside. Exact with respect to those fp32 edges."""
    inb = (d >= lo) & (d < hi)
    b = tl.minimum(tl.maximum(tl.floor((d - lo) * (1.0 / w)), 0.0), NP - 2.0).to(tl.int32)
    e_lo = lo + b.to(tl.float32) * w
    e_hi = tl.where(b == NP - 2, hi, lo + (b + 1).to(tl.float32) * w)
    b = tl.where(d < e_lo, b - 1, tl.where(d >= e_hi, b + 1, b))
    b = tl.minimum(tl.maximum(b, 0), NP - 2)
    return tl.where(inb, b, NP - 1)


@triton.jit
def _choose_bin(cnt, mss, n_lo, mass_lo, target_n, target_m, use_mass, NP: tl.constexpr):
    """Boundary bin j* of a histogram: count mode -> the bin holding the target_n-th element;
    mass mode -> the first bin whose inclusive cumulative mass reaches target_m."""
    jj = tl.arange(0, NP)
    real = jj < NP - 1
    cnt = tl.where(real, cnt, 0)
    mss = tl.where(real, mss, 0.0)
    ccum = n_lo + tl.cumsum(cnt, 0)
    mcum = mass_lo + tl.cumsum(mss, 0)
    last_nonempty = tl.max(tl.where(cnt > 0, jj, -1), 0)
    below = tl.where(use_mass, mcum < target_m, ccum < target_n) & real
    j = tl.minimum(tl.sum(below.to(tl.int32), 0), tl.maximum(last_nonempty, 0))
    reached = tl.where(use_mass, True, tl.sum(below.to(tl.int32), 0) < NP - 1)
    n_before = n_lo + tl.sum(tl.where(jj < j, cnt, 0), 0)
    m_before = mass_lo + tl.sum(tl.where(jj < j, mss, 0.0), 0)
    nb = tl.sum(tl.where(jj == j, cnt, 0), 0)
    return j, n_before, m_before, nb, reached


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
    is ``< p`` of the kept mass (docs/sampler.md §2)."""
    ii = tl.arange(0, vals.shape[0])
    e = tl.where(keep, _exp(vals - m_s), 0.0)
    c = tl.cumsum(e, 0)
    nk = tl.sum(keep.to(tl.int32), 0)
    limit = top_p * tl.sum(e, 0)
    cnt = (limit > 0).to(tl.int32) + tl.sum(((ii < nk - 1) & (c < limit)).to(tl.int32), 0)
    return tl.sum(tl.where(ii == cnt - 1, vals, 0.0), 0)
