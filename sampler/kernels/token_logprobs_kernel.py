"""Triton kernel of :func:`sampler.ops.token_logprobs.compute_token_logprobs`.

One program per row, one pass over the row's logits (any float dtype, upcast on load): online
log-sum-exp of the raw values and of ``raw / T`` in per-lane accumulators, then the token's
value. The tile layout and the accumulators are those of the fused sampling kernel, so with
the same launch config the values equal its ``raw_logprobs`` / ``temperature_logprobs`` modes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sampler.kernels.kernel_config import launch_config
from sampler.kernels.reductions import _lse, _online_lse


@triton.jit
def _token_logprobs_kernel(
    logits_ptr, stride_row, V, tok_ptr, temp_ptr, raw_out_ptr, temp_out_ptr,
    BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    R: tl.constexpr = BLOCK // VEC
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    T = tl.load(temp_ptr + row)
    NEG = float("-inf")
    acc_mr = tl.full([R], NEG, tl.float32)
    acc_lr = tl.zeros([R], dtype=tl.float32)
    acc_mt = tl.full([R], NEG, tl.float32)
    acc_lt = tl.zeros([R], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        raw = tl.load(base + offs, mask=offs < V, other=NEG).to(tl.float32)
        acc_mr, acc_lr = _online_lse(raw, acc_mr, acc_lr)
        acc_mt, acc_lt = _online_lse(tl.math.div_rn(raw, T), acc_mt, acc_lt)
    lse_r = _lse(acc_mr, acc_lr)
    lse_t = _lse(acc_mt, acc_lt)
    tok = tl.load(tok_ptr + row)
    raw_tok = tl.load(base + tok).to(tl.float32)
    tl.store(raw_out_ptr + row, raw_tok - lse_r)
    tl.store(temp_out_ptr + row, tl.math.div_rn(raw_tok, T) - lse_t)


def compute_token_logprobs_triton(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel (arguments and results as in ``compute_token_logprobs``)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    raw = torch.empty(rows, dtype=torch.float32, device=logits.device)
    temp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return raw, temp
    cfg = launch_config(vocab)
    _token_logprobs_kernel[(rows,)](
        logits, logits.stride(0), vocab, token_ids.contiguous().long(),
        temperature.contiguous().float(), raw, temp,
        BLOCK=cfg.block, VEC=cfg.vec, num_warps=cfg.num_warps, enable_fp_fusion=False,
    )
    return raw, temp
