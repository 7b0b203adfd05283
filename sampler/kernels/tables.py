"""The per-step device tables that the kernels of steps 2-6 read (penalties, logit bias, stop
ids, bad-word bans, allowed ids, grammar masks), gathered from the sampler state without copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampler.kernels.kernel_config import placeholder
from sampler.ops.bad_words import PAD_ANY


@dataclass(slots=True)
class KernelTables:
    """Device tables of one step, with 1-element dummies for steps that do not run."""

    W: int
    pbits: torch.Tensor
    pmask: torch.Tensor
    counts: torch.Tensor
    bias_ids: torch.Tensor
    bias_vals: torch.Tensor
    nbias: int
    stop_ids: torch.Tensor
    nstop: int
    bans: torch.Tensor
    nban: int
    allowed: torch.Tensor
    gbits: torch.Tensor  # [num_masked, gw] int32 grammar masks (a dummy without them)
    grow: torch.Tensor   # [rows] int32: each row's mask index, -1 for an unconstrained row
    gw: int


def compute_bad_word_bans(idx_mapping: torch.Tensor, state) -> torch.Tensor:
    """``[rows, max_words]`` int64: the last token of each bad word whose prefix matches the
    row's recent output tokens, else -1 (same rule as :func:`sampler.ops.apply_bad_words`)."""
    words = state.word_tokens[idx_mapping]  # [rows, W, L]
    lens = state.word_lens[idx_mapping]
    max_len = words.shape[-1]
    last = words[..., -1]
    if max_len > 1:
        recent = state.recent_tokens
        window = recent[idx_mapping][:, None, recent.shape[1] - (max_len - 1):]
        prefix = words[..., :-1]
        matched = ((prefix == window) | (prefix == PAD_ANY)).all(dim=-1)
    else:
        matched = torch.ones_like(last, dtype=torch.bool)
    matched &= lens > 0
    return torch.where(matched, last, -1).contiguous()


def kernel_tables(state, plan, idx_mapping: torch.Tensor,
                  bans: torch.Tensor | None = None) -> KernelTables:
    """Collects the state's tables for a launch (no copies of the large tables); ``plan`` is
    the step's :class:`~sampler.step_plan.StepPlan`."""
    dev = idx_mapping.device
    i64 = placeholder(dev, torch.int64)
    if plan.do_penalties:
        pbits, counts = state.penalty_bits, state.output_counts
        pmask = state.prompt_mask.view(torch.uint8)
    else:
        pbits = placeholder(dev, torch.int32)
        counts = pbits
        pmask = placeholder(dev, torch.uint8)
    if plan.do_bad_words and bans is None:
        bans = compute_bad_word_bans(idx_mapping, state)
    if not plan.do_bad_words:
        bans = i64
    allowed = state.allowed_mask.view(torch.uint8) if plan.do_allowed else pmask
    if plan.do_grammar:
        mask = state.token_bitmask
        gbits, grow, gw = mask.bits, mask.row_map, mask.bits.shape[1]
    else:
        gbits = grow = placeholder(dev, torch.int32)
        gw = 1
    return KernelTables(
        W=(state.vocab_size + 31) // 32, pbits=pbits, pmask=pmask, counts=counts,
        bias_ids=state.bias_ids, bias_vals=state.bias_values, nbias=state.bias_ids.shape[1],
        stop_ids=state.stop_ids, nstop=state.stop_ids.shape[1],
        bans=bans, nban=bans.shape[1] if plan.do_bad_words else 0, allowed=allowed,
        gbits=gbits, grow=grow, gw=gw,
    )
