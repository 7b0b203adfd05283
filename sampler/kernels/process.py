"""Pipeline steps 2–6 in Triton: allowed ids, bad words, min_tokens, logit bias, penalties.

Tile function :func:`_processed` turns a tile of raw float32 logits into processed values.
The small per-row lists (banned ids, stop ids, bias entries) are applied by comparing the tile
offsets against each entry. Penalties read the dense per-slot tables (prompt mask, output
counts) only where the slot's *penalty bits* (one bit per token: in the prompt or already
generated) are set, so a pass over a row costs one read of the logits plus 1/16 of it for the
bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sampler.kernels.tables import kernel_tables
from sampler.kernels.token_bitmask_kernel import _bitmask_tile, _mask_row


@triton.jit
def _processed(
    raw, offs, vmask, row, slot, V, W,
    pbits_ptr, pmask_ptr, counts_ptr, rep, freq, pres, row_pen,
    bias_ids_ptr, bias_vals_ptr, NBIAS,
    stop_ids_ptr, NSTOP, min_tok_active,
    ban_ptr, NBAN,
    allowed_ptr, row_allowed, gbits_ptr, mrow, GW,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
):
    """Pipeline steps 2-6 on one tile of raw fp32 logits (the grammar mask first: ``mrow``
    is the row's index in ``gbits_ptr``, -1 for an unconstrained row)."""
    x = raw
    if HAS_GRAMMAR:
        x = _bitmask_tile(x, offs, vmask, gbits_ptr, mrow, GW)
    if HAS_ALLOWED:
        if row_allowed:
            a = tl.load(allowed_ptr + slot * V + offs, mask=vmask, other=0)
            x = tl.where(a != 0, x, float("-inf"))
    if HAS_BAN:
        for j in range(NBAN):
            b = tl.load(ban_ptr + row * NBAN + j)
            x = tl.where(offs == b, float("-inf"), x)
    if HAS_STOP:
        if min_tok_active:
            for j in range(NSTOP):
                sid = tl.load(stop_ids_ptr + slot * NSTOP + j)
                x = tl.where(offs == sid, float("-inf"), x)
    if HAS_BIAS:
        for j in range(NBIAS):
            bid = tl.load(bias_ids_ptr + slot * NBIAS + j)
            bv = tl.load(bias_vals_ptr + slot * NBIAS + j)
            x = tl.where(offs == bid, x + bv, x)
    if HAS_PEN:
        if row_pen:
            words = tl.load(pbits_ptr + slot * W + offs // 32, mask=vmask, other=0)
            touched = ((words >> (offs % 32)) & 1) != 0
            x = _penalized(x, offs, touched, slot, V, pmask_ptr, counts_ptr, rep, freq, pres)
    return x


@triton.jit
def _penalized(x, offs, touched, slot, V, pmask_ptr, counts_ptr, rep, freq, pres):
    """Step 6, the penalties, on a tile whose ``touched`` tokens (in the prompt or the output
    so far) are those its row's tables may mark: only their table entries are read."""
    inp = tl.load(pmask_ptr + slot * V + offs, mask=touched, other=0) != 0
    cnt = tl.load(counts_ptr + slot * V + offs, mask=touched, other=0)
    seen_out = cnt > 0
    # (only positive values are divided, the others 1.0: reductions._div_t says why)
    pen = tl.where(x > 0, tl.math.div_rn(tl.where(x > 0, x, 1.0), rep), x * rep)
    x = tl.where(inp | seen_out, pen, x)
    x = x - freq * cnt.to(tl.float32)
    return x - pres * seen_out.to(tl.float32)


@triton.jit
def _row_processing(fparams_ptr, stride_f, iparams_ptr, stride_i, positions_ptr, slot):
    """A row's parameters of steps 2-6 and its temperature: (T, rep, freq, pres, row_pen,
    min_tok_active, row_allowed)."""
    T = tl.load(fparams_ptr + slot * stride_f + 0)
    rep = tl.load(fparams_ptr + slot * stride_f + 3)
    freq = tl.load(fparams_ptr + slot * stride_f + 4)
    pres = tl.load(fparams_ptr + slot * stride_f + 5)
    min_tok_active = tl.load(positions_ptr + slot) < tl.load(iparams_ptr + slot * stride_i + 3)
    row_allowed = tl.load(iparams_ptr + slot * stride_i + 7) != 0
    row_pen = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    return T, rep, freq, pres, row_pen, min_tok_active, row_allowed


@triton.jit
def _row_flags(iparams_ptr, stride_i, slot, V):
    """A row's selection and logprobs flags: (greedy, k_on, top_k, lp_on, rk_on, nlp, mode)."""
    top_k = tl.load(iparams_ptr + slot * stride_i + 2)
    nlp = tl.load(iparams_ptr + slot * stride_i + 4)
    mode = tl.load(iparams_ptr + slot * stride_i + 5)
    greedy = tl.load(iparams_ptr + slot * stride_i + 6) != 0
    raw_family = (mode == 0) | (mode == 1) | (mode == 4)
    lp_on = (nlp != -2) & raw_family & (nlp >= 0)
    k_on = (top_k > 0) & (top_k < V)
    return greedy, k_on, top_k, lp_on, lp_on & (nlp > 0), nlp, mode


@triton.jit
def _processing_kernel(
    x_ptr, stride_row, V, W, idx_ptr,
    pbits_ptr, pmask_ptr, counts_ptr, fparams_ptr, stride_f,
    bias_ids_ptr, bias_vals_ptr, NBIAS, stop_ids_ptr, NSTOP, iparams_ptr, stride_i, pos_ptr,
    ban_ptr, NBAN, allowed_ptr, gbits_ptr, grow_ptr, GW,
    HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STOP: tl.constexpr,
    HAS_BAN: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(idx_ptr + row)
    _T, rep, freq, pres, row_pen, min_tok_active, row_allowed = _row_processing(
        fparams_ptr, stride_f, iparams_ptr, stride_i, pos_ptr, slot)
    mrow = _mask_row(grow_ptr, row, HAS_GRAMMAR)
    base = x_ptr + row.to(tl.int64) * stride_row
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        vmask = offs < V
        x = tl.load(base + offs, mask=vmask, other=0.0)
        x = _processed(x, offs, vmask, row, slot, V, W, pbits_ptr, pmask_ptr, counts_ptr,
                       rep, freq, pres, row_pen, bias_ids_ptr, bias_vals_ptr, NBIAS,
                       stop_ids_ptr, NSTOP, min_tok_active, ban_ptr, NBAN, allowed_ptr,
                       row_allowed, gbits_ptr, mrow, GW, HAS_PEN, HAS_BIAS, HAS_STOP, HAS_BAN,
                       HAS_ALLOWED, HAS_GRAMMAR)
        tl.store(base + offs, x, mask=vmask)


def apply_processing(logits: torch.Tensor, idx_mapping: torch.Tensor, state, plan,
                     bans: torch.Tensor | None = None) -> None:
    """Applies steps 2–6 to float32 ``logits`` in place, like the torch ops in pipeline order.

    Args:
        logits: ``[rows, vocab]`` float32, contiguous in the vocab dimension.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        state: the flushed :class:`~sampler.state.SamplerState`.
        plan: the step's :class:`~sampler.step_plan.StepPlan` (which steps run).
        bans: ``[rows, n]`` int64 banned ids per row (bad words; -1 = none), see
            :func:`sampler.kernels.tables.compute_bad_word_bans`.
    """
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    rows, vocab = logits.shape
    if rows == 0:
        return
    t = kernel_tables(state, plan, idx_mapping, bans)
    _processing_kernel[(rows,)](
        logits, logits.stride(0), vocab, t.W, idx_mapping,
        t.pbits, t.pmask, t.counts, state.fparams, state.fparams.stride(0),
        t.bias_ids, t.bias_vals, t.nbias, t.stop_ids, t.nstop, state.iparams,
        state.iparams.stride(0), state.positions, t.bans, t.nban, t.allowed, t.gbits, t.grow,
        t.gw, HAS_PEN=plan.do_penalties, HAS_BIAS=plan.do_logit_bias,
        HAS_STOP=plan.do_min_tokens, HAS_BAN=plan.do_bad_words, HAS_ALLOWED=plan.do_allowed,
        HAS_GRAMMAR=plan.do_grammar,
        BLOCK=min(2048, triton.next_power_of_2(vocab)), enable_fp_fusion=False,
    )
