"""Pipeline step 6: repetition, frequency and presence penalties.

- repetition ``r`` over prompt ∪ output tokens: ``logit > 0 -> logit / r``, else ``logit * r``;
- frequency ``f`` over output tokens: ``logit -= f * count``;
- presence ``p`` over output tokens: ``logit -= p * (count > 0)``;

applied in that order, in float32. The counts live in a per-slot ``[max_num_seqs, vocab]``
table updated on the device from each step's sampled ids.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """Applies the three penalties of each row's slot (in place).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        prompt_mask: ``[max_num_seqs, vocab]`` bool, True for ids in the slot's prompt.
        output_counts: ``[max_num_seqs, vocab]`` int32, occurrences in the slot's output.
        repetition: ``[max_num_seqs]`` float32, > 0 (1.0 = off).
        frequency: ``[max_num_seqs]`` float32 (0.0 = off).
        presence: ``[max_num_seqs]`` float32 (0.0 = off).

    Example:
        >>> x = torch.tensor([[2.0, -2.0, 1.0]])
        >>> apply_penalties(x, torch.tensor([0]), torch.tensor([[True, True, False]]),
        ...                 torch.tensor([[0, 0, 2]], dtype=torch.int32), torch.tensor([2.0]),
        ...                 torch.tensor([0.5]), torch.tensor([0.25]))
        >>> x
        tensor([[ 1.0000, -4.0000, -0.7500]])
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    counts = output_counts[idx_mapping]  # [rows, vocab] int32
    seen_out = counts > 0
    rep = repetition[idx_mapping][:, None]
    seen = prompt_mask[idx_mapping] | seen_out
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(frequency[idx_mapping][:, None] * counts.to(torch.float32))
    logits.sub_(presence[idx_mapping][:, None] * seen_out.to(torch.float32))
