"""Per-lane reductions shared by the kernels: log-sum-exps, the greedy argmax, the k-th
largest lane maximum, the raw-family logprobs values.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _exp(x):
    """``exp(x)`` as ``2 ** (x * log2(e))`` with results below 2^-126 flushed to zero: the
    value of ``tl.exp`` (the same scaling and hardware ``ex2``) without its subnormal
    fix-up, which costs three more instructions a token on the GPU."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _div_t(x, T):
    """``x / T`` correctly rounded (``div_rn``), with -inf passed through rather than
    divided. On the GPU a dividend whose quotient is not a normal number (an infinity, a
    zero) sends ``div_rn`` down its slow path for its whole warp, so masked or banned tokens
    (-inf) in most warps of a row would take it on every pass: they divide 1.0 instead."""
    fin = x > float("-inf")
    return tl.where(fin, tl.math.div_rn(tl.where(fin, x, 1.0), T), x)


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
def _sampled_value(base, tok, lp_on, mode, T, lse_r, lse_t):
    """The sampled token's (raw logit, raw-family logprobs value, rank so far) where its row
    asks for logprobs (``lp_on``: rank 1 until larger values are counted), else (-inf, NaN,
    0)."""
    raw_tok = float("-inf")
    v_tok = float("nan")
    rank = 0
    if lp_on:
        raw_tok, v_tok = _token_value(base, tok, mode, T, lse_r, lse_t)
        rank = 1
    return raw_tok, v_tok, rank


@triton.jit
def _best(acc_v, acc_i):
    """Lane (value, index) accumulators -> the maximum and its lowest index (0 if none)."""
    best = tl.max(acc_v, 0)
    idx = tl.min(tl.where(acc_v == best, acc_i, 2147483647), 0)
    return best, tl.where(best > float("-inf"), idx, 0)


@triton.jit
def _kth_largest(lanes, k):
    """The k-th largest of a row's per-lane maxima (-inf when there are fewer than k lanes):
    k distinct tokens are >= it, so it bounds the row's k-th largest value from below."""
    ordered = tl.sort(lanes, 0, descending=True)
    jj = tl.arange(0, lanes.shape[0])
    return tl.max(tl.where(jj == k - 1, ordered, float("-inf")), 0)
