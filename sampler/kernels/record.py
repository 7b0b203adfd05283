"""The end of a step in one Triton launch: each row's slot advanced by its sampled token.

Same effect as :meth:`sampler.state.SamplerState.record_sampled` (the torch ops, which stay
the oracle and the CPU path): the output position + 1, the token counted in the output
counts, its penalty bit and (for a row with penalties) its touch bit set, and the recent
tokens shifted left with the token appended. One program per row; the slots of a step are
distinct, so no two programs touch the same table row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sampler.kernels.kernel_config import placeholder
from sampler.slot_params import FREQUENCY, PRESENCE, REPETITION

REP: tl.constexpr = tl.constexpr(REPETITION)
FREQ: tl.constexpr = tl.constexpr(FREQUENCY)
PRES: tl.constexpr = tl.constexpr(PRESENCE)


@triton.jit
def _record_row(
    slot, tok, positions_ptr, counts_ptr, pbits_ptr, tbits_ptr, fparams_ptr, stride_f,
    recent_ptr, V, W, RW, HAS_COUNTS: tl.constexpr, HAS_TOUCH: tl.constexpr,
    HAS_RECENT: tl.constexpr, RWP2: tl.constexpr,
):
    """Advances ``slot`` by its sampled token ``tok`` (every table the state keeps)."""
    tl.store(positions_ptr + slot, tl.load(positions_ptr + slot) + 1)
    word = slot * W + (tok >> 5)
    bit = (tl.full((), 1, tl.int32) << (tok & 31).to(tl.int32))
    if HAS_COUNTS:
        cell = counts_ptr + slot * V + tok
        tl.store(cell, tl.load(cell) + 1)
        tl.store(pbits_ptr + word, tl.load(pbits_ptr + word) | bit)
    if HAS_TOUCH:
        rep = tl.load(fparams_ptr + slot * stride_f + REP)
        freq = tl.load(fparams_ptr + slot * stride_f + FREQ)
        pres = tl.load(fparams_ptr + slot * stride_f + PRES)
        if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
            tl.store(tbits_ptr + word, tl.load(tbits_ptr + word) | bit)
    if HAS_RECENT:
        j = tl.arange(0, RWP2)
        base = recent_ptr + slot * RW
        shifted = tl.load(base + j + 1, mask=j < RW - 1, other=0)
        shifted = tl.where(j == RW - 1, tok, shifted)
        tl.debug_barrier()  # every entry is read before any is overwritten
        tl.store(base + j, shifted, mask=j < RW)


@triton.jit
def _record_kernel(
    idx_ptr, tok_ptr, positions_ptr, fparams_ptr, stride_f, V, W,
    r_counts_ptr, r_pbits_ptr, r_tbits_ptr, r_recent_ptr, R_RW,
    R_COUNTS: tl.constexpr, R_TOUCH: tl.constexpr, R_RECENT: tl.constexpr,
    R_RWP2: tl.constexpr,
):
    row = tl.program_id(0)
    _record_row(tl.load(idx_ptr + row), tl.load(tok_ptr + row), positions_ptr, r_counts_ptr,
                r_pbits_ptr, r_tbits_ptr, fparams_ptr, stride_f, r_recent_ptr, V, W, R_RW,
                R_COUNTS, R_TOUCH, R_RECENT, R_RWP2)


def record_kwargs(state, device) -> dict:
    """The state's tables as the record keyword arguments (``r_*``: placeholders for the
    absent ones, with the matching constexprs) that ``_record_kernel``, and the kernels that
    record a step themselves, take."""
    none32 = placeholder(device, torch.int32)
    recent = state.recent_tokens
    rw = recent.shape[1] if recent is not None else 1
    return dict(
        r_counts_ptr=none32 if state.output_counts is None else state.output_counts,
        r_pbits_ptr=none32 if state.penalty_bits is None else state.penalty_bits,
        r_tbits_ptr=none32 if state.touch_bits is None else state.touch_bits,
        r_recent_ptr=placeholder(device, torch.int64) if recent is None else recent,
        R_RW=rw, R_COUNTS=state.output_counts is not None,
        R_TOUCH=state.touch_bits is not None, R_RECENT=recent is not None,
        R_RWP2=triton.next_power_of_2(rw))


def record_sampled_triton(state, idx_mapping: torch.Tensor, token_ids: torch.Tensor,
                          rows_host, *, launched: bool = False) -> None:
    """:meth:`~sampler.state.SamplerState.record_sampled` as one launch (same arguments);
    ``launched``: a kernel of the step already advanced the device tables (only the host
    positions are left)."""
    if idx_mapping.shape[0] and not launched:
        _record_kernel[(idx_mapping.shape[0],)](
            idx_mapping, token_ids, state.positions, state.fparams, state.fparams.stride(0),
            state.vocab_size, (state.vocab_size + 31) // 32,
            **record_kwargs(state, idx_mapping.device), num_warps=1)
    if rows_host is not None:
        state.pos_host[rows_host] += 1
