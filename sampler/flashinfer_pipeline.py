"""The FlashInfer backend of the sampling pipeline (statistically equal to the others).

Same contract as :func:`sampler.pipeline.run_pipeline`. A step runs here when the host-side
plan allows it (:func:`unsupported_reason`); otherwise it runs on the Triton or torch path
given at construction (decided on the host, no device sync). The draw uses FlashInfer's Philox
RNG, not the per-row counter-based noise, so a request that set a seed never runs here. What
runs where: docs/sampler_kernels.md (The FlashInfer backend). FlashInfer 0.6.4 signatures.
"""

from __future__ import annotations

import logging
import secrets
from typing import Callable

import torch

from sampler.ops import compute_logprob_outputs
from sampler.sampler_output import SamplerOutput
from sampler.pipeline import (
    PROCESSED_LOGITS,
    PROCESSED_LOGPROBS,
    _raw_values,
    apply_masks_and_penalties,
)
from sampler.step_plan import StepPlan
from sampler.slot_params import LOG_MIN_P, MODE, NUM_LOGPROBS, TEMPERATURE, TOP_K, TOP_P
from sampler.state import SamplerState

logger = logging.getLogger(__name__)
_logged_reasons: set[str] = set()

# float32 elements of one logprobs table chunk (64 MB): bounds the [rows, vocab] temporaries
LOGPROB_CHUNK_ELEMENTS = 1 << 24
# Philox offset advance per draw and row, as flashinfer's own generator path reserves
PHILOX_PER_ROW = 32


def unsupported_reason(plan: StepPlan, precision: str, vocab: int) -> str | None:
    """Why a step cannot run on the FlashInfer backend (None when it can).

    Args:
        plan: the step's host-side predicates.
        precision: the Sampler's noise precision ("fp32" or "fp64").
        vocab: the logits' width.

    Returns:
        A short reason, or None.
    """
    if plan.any_random and precision != "fp32":
        return "fp64 noise"
    if plan.any_seeded:
        return "a random row whose request set its own seed"
    if PROCESSED_LOGPROBS in plan.modes or PROCESSED_LOGITS in plan.modes:
        return "processed logprobs modes"
    if plan.max_num_logprobs >= vocab:
        return "whole-vocab logprobs"
    return None


def compute_raw_logprob_outputs(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    state: SamplerState,
    plan: StepPlan,
    token_ids: torch.Tensor,
    chunk_elements: int = LOGPROB_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw-family logprob outputs of given tokens, as the torch pipeline computes them.

    Args:
        logits: ``[rows, vocab]`` untouched model logits (any float dtype and strides).
        idx_mapping: ``[rows]`` int64, the slot of each row.
        state: the flushed sampler state.
        plan: the step's plan; ``plan.modes`` holds raw-family modes only.
        token_ids: ``[rows]`` int64, the sampled tokens.
        chunk_elements: rows are processed in chunks of about this many logits.

    Returns:
        ``(logprobs, ranks, topk_ids, topk_values)`` as in
        :func:`sampler.ops.compute_logprob_outputs`.
    """
    rows, vocab = logits.shape
    f, i = state.fparams, state.iparams
    temperature = f[idx_mapping, TEMPERATURE]
    num_logprobs = i[idx_mapping, NUM_LOGPROBS]
    row_mode = i[idx_mapping, MODE][:, None]
    modes = sorted(plan.modes)
    chunk = max(1, chunk_elements // max(vocab, 1))
    parts = []
    for start in range(0, rows, chunk):
        rs = slice(start, min(rows, start + chunk))
        table = _raw_values(logits[rs], modes[0], temperature[rs], copy=False)
        for mode in modes[1:]:
            table = torch.where(row_mode[rs] == mode,
                                _raw_values(logits[rs], mode, temperature[rs], copy=False), table)
        parts.append(compute_logprob_outputs(table, token_ids[rs], num_logprobs[rs],
                                             plan.max_num_logprobs))
    if len(parts) == 1:
        return parts[0]
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))  # type: ignore


class FlashInferPipeline:
    """The FlashInfer backend: a callable with :func:`sampler.pipeline.run_pipeline`'s
    signature. Made once per Sampler (see :func:`sampler.backends.pipeline_fn`).

    Args:
        device: the logits' device.
        fallback: the pipeline function for steps FlashInfer cannot sample.
        fallback_backend: its name, "triton" or "torch" (with "triton" on CUDA, steps 2–6
            of the steps run here use the Triton processing kernel).
        seed: seed of the Philox stream (default: a random one, so two samplers never share
            a stream).

    Attributes:
        num_flashinfer_steps, num_fallback_steps: steps run here / on the fallback.
    """

    def __init__(self, device: torch.device, fallback: Callable[..., SamplerOutput],
                 fallback_backend: str, seed: int | None = None) -> None:
        import flashinfer.sampling

        self._fs = flashinfer.sampling
        self.device = torch.device(device)
        self.fallback, self.fallback_backend = fallback, fallback_backend
        self._triton_processing = self.device.type == "cuda" and fallback_backend == "triton"
        seed = secrets.randbits(63) if seed is None else seed
        self._seed = torch.tensor([seed], dtype=torch.int64, device=self.device)
        self._offset = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.num_flashinfer_steps = 0
        self.num_fallback_steps = 0

    def __call__(
        self,
        logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        state: SamplerState,
        plan: StepPlan,
        *,
        inplace: bool,
        precision: str = "fp32",
    ) -> SamplerOutput:
        """Samples one token per row (arguments and result as in ``run_pipeline``; float32
        logits are overwritten only when ``inplace`` and no row asked for logprobs)."""
        rows, vocab = logits.shape
        reason = unsupported_reason(plan, precision, vocab)
        if reason is not None:
            self.num_fallback_steps += 1
            if reason not in _logged_reasons:
                _logged_reasons.add(reason)
                logger.info("sampler flashinfer backend: steps with %s run on %s", reason,
                            self.fallback_backend)
            return self.fallback(logits, idx_mapping, state, plan, inplace=inplace,
                                 precision=precision)
        self.num_flashinfer_steps += 1
        if rows == 0:
            return SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64,
                                                       device=logits.device))
        x = self._processed(logits, idx_mapping, state, plan, inplace=inplace)
        greedy_ids = x.argmax(dim=-1) if plan.any_greedy or not plan.any_random else None
        if plan.any_random:
            drawn = self._draw(x, idx_mapping, state, plan).long()
            token_ids = drawn if greedy_ids is None else \
                torch.where(state.is_greedy[idx_mapping], greedy_ids, drawn)
        else:
            token_ids = greedy_ids
        if not plan.any_logprobs:
            return SamplerOutput(token_ids=token_ids)
        return SamplerOutput(token_ids, *compute_raw_logprob_outputs(
            logits, idx_mapping, state, plan, token_ids))

    def _processed(self, logits: torch.Tensor, idx: torch.Tensor, state: SamplerState,
                   plan: StepPlan, *, inplace: bool) -> torch.Tensor:
        """Steps 2–6 when the plan needs them, into float32 logits the caller's raw values
        never depend on; else ``logits`` itself (any dtype)."""
        if not (plan.do_allowed or plan.do_grammar or plan.do_bad_words or plan.do_min_tokens
                or plan.do_logit_bias or plan.do_penalties):
            return logits
        if logits.dtype != torch.float32:
            x = logits.float()
        elif inplace and not plan.any_logprobs:
            x = logits
        else:
            x = logits.clone(memory_format=torch.contiguous_format)
        if self._triton_processing:
            from sampler.kernels.process import apply_processing

            apply_processing(x, idx, state, plan)
            return x
        apply_masks_and_penalties(x, idx, state, plan)
        return x

    def _draw(self, x: torch.Tensor, idx: torch.Tensor, state: SamplerState,
              plan: StepPlan) -> torch.Tensor:
        """Steps 8–12 of every row through flashinfer.sampling; ``[rows]`` int32 ids."""
        fs = self._fs
        f, i = state.fparams, state.iparams
        rows, vocab = x.shape
        temperature = f[idx, TEMPERATURE] if plan.do_temperature else None  # [rows] fp32
        probs = fs.softmax(x.contiguous(), temperature=temperature)  # [rows, vocab] fp32
        if plan.do_min_p:
            min_p = torch.exp(f[idx, LOG_MIN_P])  # 0 where min-p is off
            probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], 0.0)
            if not plan.do_top_k:  # top_k_renorm_probs renormalises; the samplers do not
                probs.div_(probs.sum(dim=-1, keepdim=True))
        if plan.do_top_k:
            k = i[idx, TOP_K]
            k = torch.where((k > 0) & (k < vocab), k, vocab).to(torch.int32)  # off: keep all
            probs = fs.top_k_renorm_probs(probs, k)
        if plan.do_top_p:
            ids = fs.top_p_sampling_from_probs(probs, f[idx, TOP_P], deterministic=True,
                                               seed=self._seed, offset=self._offset)
        else:
            ids = fs.sampling_from_probs(probs, deterministic=True, seed=self._seed,
                                         offset=self._offset)
        self._offset.add_((rows * PHILOX_PER_ROW + 3) // 4 * 4)
        return ids
