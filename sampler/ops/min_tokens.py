"""Pipeline step 4: min_tokens — while a row has produced fewer than ``min_tokens`` tokens,
every stop id (its stop_token_ids and the model's EOS ids, EOS even under ignore_eos) is -inf.
"""

from __future__ import annotations

import torch


def apply_min_tokens(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    positions: torch.Tensor,
    min_tokens: torch.Tensor,
    stop_ids: torch.Tensor,
) -> None:
    """Masks the stop ids of rows that have not reached ``min_tokens`` (in place).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        positions: ``[max_num_seqs]`` int64, output tokens produced so far per slot.
        min_tokens: ``[max_num_seqs]`` int64 per slot.
        stop_ids: ``[max_num_seqs, max_stop]`` int64, the slot's stop ids padded with -1.
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    active = positions[idx_mapping] < min_tokens[idx_mapping]  # [rows]
    ids = stop_ids[idx_mapping]  # [rows, max_stop]
    ban = (active[:, None] & (ids >= 0)).expand_as(ids)
    values = torch.where(ban, float("-inf"), float("inf")).to(logits.dtype)
    logits.scatter_reduce_(1, ids.clamp_min(0), values, reduce="amin")
