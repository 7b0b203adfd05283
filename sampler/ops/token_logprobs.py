"""Sampled-token logprobs in two fixed modes at once (docs/sampler.md §3), for RL rollouts.

A row's ``logprobs`` output carries one value in the row's own ``logprobs_mode``. RL callers
often want the sampled token's value under two fixed definitions, whatever that mode is:

- ``raw_logprobs``: ``log_softmax(z)[t]``, ``z`` the untouched model logits in float32;
- ``temperature_logprobs``: ``log_softmax(z / T)[t]``, ``T`` the row's temperature (1 for
  greedy rows), computed in float32.

Both come from the untouched logits, so they must be computed from logits the sampling pipeline
has not overwritten (the engine passes a copy when the torch pipeline works in place).
"""

from __future__ import annotations

import torch

TOKEN_LOGPROB_BACKENDS = ("torch", "triton")


def _check(logits: torch.Tensor, token_ids: torch.Tensor, temperature: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [rows, vocab], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    if token_ids.shape != (rows,):
        raise ValueError(f"token_ids: expected shape [{rows}], got {tuple(token_ids.shape)}")
    if temperature.shape != (rows,):
        raise ValueError(f"temperature: expected shape [{rows}], got {tuple(temperature.shape)}")
    if token_ids.device != logits.device or temperature.device != logits.device:
        raise ValueError("token_ids, temperature: must be on the logits' device "
                         f"({logits.device})")


def compute_token_logprobs_torch(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`compute_token_logprobs` (same values as the torch pipeline's
    ``raw_logprobs`` / ``temperature_logprobs`` modes, bit for bit)."""
    index = token_ids.long()[:, None]
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(1, index)[:, 0]
    scaled = logits.float() / temperature.float()[:, None]
    temp = torch.log_softmax(scaled, dim=-1).gather(1, index)[:, 0]
    return raw, temp


def compute_token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: torch.Tensor,
    *,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw and the temperature-scaled logprob of one token per row.

    Args:
        logits: ``[rows, vocab]`` float32/bf16/fp16, untouched model logits (never modified).
        token_ids: ``[rows]`` int64, the token of each row (e.g. the sampled one).
        temperature: ``[rows]`` float32, each row's temperature (> 0; pass 1 for greedy rows).
        backend: "torch" (reference, any device) or "triton" (one pass over each row, no
            float32 copy of the logits; CUDA, or the CPU under ``TRITON_INTERPRET=1``);
            "flashinfer" (a Sampler's backend name) means "triton" where available, else
            "torch".

    Returns:
        ``(raw_logprobs, temperature_logprobs)``, two ``[rows]`` float32 tensors:
        ``log_softmax(z)[t]`` and ``log_softmax(z / T)[t]`` with ``z = logits.float()``.

    Example:
        >>> z = torch.tensor([[0.0, 1.0, 2.0]])
        >>> raw, temp = compute_token_logprobs(z, torch.tensor([2]), torch.tensor([2.0]))
        >>> round(raw.item(), 4), round(temp.item(), 4)
        (-0.4076, -0.7784)
    """
    _check(logits, token_ids, temperature)
    if backend == "flashinfer":  # the Sampler's backend name: its logprobs are ours
        from sampler.backends import fallback_backend

        backend = fallback_backend(logits.device)
    if backend == "torch":
        return compute_token_logprobs_torch(logits, token_ids, temperature)
    if backend == "triton":
        from sampler.kernels.token_logprobs_kernel import compute_token_logprobs_triton

        return compute_token_logprobs_triton(logits, token_ids, temperature)
    raise ValueError(f"backend: must be one of {', '.join(TOKEN_LOGPROB_BACKENDS)}, "
                     f"got {backend!r}")
