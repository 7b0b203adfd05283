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
