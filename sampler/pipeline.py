"""The sampling pipeline of docs/sampler.md §2 over a batch, on the torch ops.

One ordered pass; each step runs only when the host-side :class:`~sampler.step_plan.StepPlan` says
a row needs it. Float32 logits are the working buffer when ``inplace`` (the engine's case);
bf16/fp16 logits get one float32 working copy (none for an all-greedy batch that no step
touches) and stay untouched (they are the raw snapshot).
Values a raw logprobs mode needs are taken from the untouched logits (for half input: from its
still untouched float32 working copy, the same values) before anything mutates; a float32 copy
of the raw logits is made only for ``raw_logits`` rows when a step mutates.
"""

from __future__ import annotations

import torch

from sampler.ops import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k_top_p,
    compute_logprob_outputs,
    compute_sampled_ids,
)
from sampler.ops.gumbel import NoisePrecision
from sampler.sampler_output import SamplerOutput
from sampler.step_plan import StepPlan
from sampler.slot_params import (
    FREQUENCY,
    LOG_MIN_P,
    MIN_TOKENS,
    MODE,
    MODE_CODES,
    NUM_LOGPROBS,
    PRESENCE,
    REPETITION,
    SAMPLE_INDEX,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)
from sampler.state import SamplerState

RAW_LOGPROBS = MODE_CODES["raw_logprobs"]
RAW_LOGITS = MODE_CODES["raw_logits"]
TEMPERATURE_LOGPROBS = MODE_CODES["temperature_logprobs"]
PROCESSED_LOGPROBS = MODE_CODES["processed_logprobs"]
PROCESSED_LOGITS = MODE_CODES["processed_logits"]
_RAW_CODES = (RAW_LOGPROBS, RAW_LOGITS, TEMPERATURE_LOGPROBS)


def _raw_values(
    logits: torch.Tensor, mode: int, temperature: torch.Tensor, copy: bool
) -> torch.Tensor:
    """Values of a raw mode from the untouched ``logits`` (always float32)."""
    if mode == RAW_LOGPROBS:
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    if mode == RAW_LOGITS:
        if logits.dtype != torch.float32:
            return logits.float()
        return logits.clone() if copy else logits
    return torch.log_softmax(logits.float() / temperature[:, None], dim=-1)


def apply_masks_and_penalties(x: torch.Tensor, idx: torch.Tensor, state, plan: StepPlan) -> None:
    """Steps 2-6 (grammar masks, allowed ids, bad words, min_tokens, logit bias, penalties)
    on float32 ``x`` in place, each only when the plan needs it."""
    f, i = state.fparams, state.iparams
    if plan.do_grammar:
        mask = state.token_bitmask
        apply_token_bitmask(x, mask.bits, mask.rows)
    if plan.do_allowed:
        apply_allowed_token_ids(x, idx, state.has_allowed, state.allowed_mask)
    if plan.do_bad_words:
        apply_bad_words(x, idx, state.word_tokens, state.word_lens, state.recent_tokens)
    if plan.do_min_tokens:
        apply_min_tokens(x, idx, state.positions, i[:, MIN_TOKENS], state.stop_ids)
    if plan.do_logit_bias:
        apply_logit_bias(x, idx, state.bias_ids, state.bias_values)
    if plan.do_penalties:
        apply_penalties(x, idx, state.prompt_mask, state.output_counts,
                        f[:, REPETITION], f[:, FREQUENCY], f[:, PRESENCE])


def run_pipeline(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    state: SamplerState,
    plan: StepPlan,
    *,
    inplace: bool,
    precision: NoisePrecision = "fp32",
) -> SamplerOutput:
    """Samples one token per row and computes the requested logprobs.

    Args:
        logits: ``[rows, vocab]`` float32/bf16/fp16, any strides.
        idx_mapping: ``[rows]`` int64 on the logits' device, the slot of each row.
        state: the flushed per-slot state.
        plan: the host-side predicates of this batch.
        inplace: float32 logits may be overwritten (they end as the processed logits).
        precision: Gumbel noise precision.

    Returns:
        The step's :class:`SamplerOutput` (device tensors).
    """
    f, i = state.fparams, state.iparams
    idx = idx_mapping
    mutates = plan.mutates

    processed_modes = PROCESSED_LOGPROBS in plan.modes or PROCESSED_LOGITS in plan.modes
    half = logits.dtype != torch.float32
    if half:
        # all-greedy, nothing to mask and no processed values: argmax reads the half input
        # directly (the upcast is exact, so the result is the float32 argmax)
        needs_fp32 = mutates or plan.any_random or processed_modes
        x = logits.float() if needs_fp32 else logits
    elif mutates and not inplace:
        x = logits.clone()
    else:
        x = logits

    # 1. raw snapshot: values of raw modes come from the untouched logits. A half input's
    # float32 working copy is still untouched here and holds exactly the same values, so
    # they come from it (no second float32 copy of the logits; it is copied again only for
    # raw_logits when a step mutates it). fp16 on CUDA keeps log_softmax's fused
    # half-to-float kernel, which makes no copy.
    values: dict[int, torch.Tensor] = {}
    from_copy = half and x is not logits
    for mode in _RAW_CODES:
        if mode in plan.modes:
            fused = mode == RAW_LOGPROBS and logits.is_cuda and logits.dtype == torch.float16
            if from_copy and not fused:
                values[mode] = _raw_values(x, mode, f[idx, TEMPERATURE], copy=mutates)
            else:
                values[mode] = _raw_values(logits, mode, f[idx, TEMPERATURE],
                                           copy=mutates and inplace)

    # 2-6. masks and penalties (every row)
    apply_masks_and_penalties(x, idx, state, plan)
    # 8-11. random rows only: greedy slots hold T = 1, min-p/top-k/top-p off.
    if plan.do_temperature:
        apply_temperature(x, idx, f[:, TEMPERATURE])
    if plan.do_min_p:
        apply_min_p(x, idx, f[:, LOG_MIN_P])
    if plan.do_top_k or plan.do_top_p:
        apply_top_k_top_p(x, idx, i[:, TOP_K], f[:, TOP_P], do_top_k=plan.do_top_k,
                          do_top_p=plan.do_top_p, max_top_k=plan.max_top_k or None)
    # 7 + 12. greedy argmax / Gumbel-max draw
    token_ids = compute_sampled_ids(
        x, idx, state.is_greedy, i[:, SEED], state.positions, i[:, SAMPLE_INDEX],
        any_greedy=plan.any_greedy, any_random=plan.any_random, precision=precision,
    )
    if not plan.any_logprobs:
        return SamplerOutput(token_ids=token_ids)

    if PROCESSED_LOGPROBS in plan.modes:
        values[PROCESSED_LOGPROBS] = torch.log_softmax(x, dim=-1)
    if PROCESSED_LOGITS in plan.modes:
        values[PROCESSED_LOGITS] = x
    modes = sorted(values)
    table = values[modes[0]]
    if len(modes) > 1:
        row_mode = i[idx, MODE][:, None]
        for mode in modes[1:]:
            table = torch.where(row_mode == mode, values[mode], table)
    logprobs, ranks, topk_ids, topk_values = compute_logprob_outputs(
        table, token_ids, i[idx, NUM_LOGPROBS], plan.max_num_logprobs
    )
    return SamplerOutput(token_ids, logprobs, ranks, topk_ids, topk_values)
