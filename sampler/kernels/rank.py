"""The sampled token's rank counted over vocab chunks (grid rows x chunks), for the rows the
candidate path settled but for their rank (``done == 2``)."""

from __future__ import annotations

import triton
import triton.language as tl

from sampler.kernels.kernel_config import REC_LSE_R, REC_LSE_T, REC_WIDTH
from sampler.kernels.reductions import _mode_value


@triton.jit
def _chunk_rank_kernel(
    logits_ptr, stride_row, V, idx_ptr, fparams_ptr, stride_f, iparams_ptr, stride_i,
    rec_ptr, done_ptr, vtok_ptr, rank_ptr, CHUNK, BLOCK: tl.constexpr,
):
    """Adds the chunk's count of values above the sampled token's to the rank of a row
    flagged 2 (the log-sum-exps from the candidate path's per-row record ``rec``)."""
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
