"""Pipeline step 5: logit_bias — ``logit[t] += bias[t]`` for the request's biased ids."""

from __future__ import annotations

import torch


def apply_logit_bias(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    bias_ids: torch.Tensor,
    bias_values: torch.Tensor,
) -> None:
    """Adds each slot's sparse logit bias to its row (in place).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        bias_ids: ``[max_num_seqs, max_bias]`` int64, distinct ids per slot; padding entries
            are 0 with a value of 0.0 (adding 0.0 changes nothing).
        bias_values: ``[max_num_seqs, max_bias]`` float32 biases.
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    logits.scatter_add_(1, bias_ids[idx_mapping], bias_values[idx_mapping])
