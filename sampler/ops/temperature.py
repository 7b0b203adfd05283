"""Pipeline step 8: temperature — ``logit /= T`` (greedy slots store T = 1, a no-op)."""

from __future__ import annotations

import torch


def apply_temperature(
    logits: torch.Tensor, idx_mapping: torch.Tensor, temperature: torch.Tensor
) -> None:
    """Divides each row by its slot's temperature (in place, float32).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        temperature: ``[max_num_seqs]`` float32, > 0 (1.0 for greedy slots).
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    logits.div_(temperature[idx_mapping][:, None])
