"""Pipeline step 9: min-p — drop t where ``logit_t < max_logit + ln(min_p)``.

``ln(min_p)`` is computed once on the host (float64, rounded to float32) when the request is
added, so every backend uses the same threshold bits; ``min_p = 0`` stores -inf (off).
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, idx_mapping: torch.Tensor, log_min_p: torch.Tensor) -> None:
    """Masks tokens whose probability is below ``min_p`` times the row's top probability.

    Args:
        logits: ``[rows, vocab]`` float32 (after temperature), modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        log_min_p: ``[max_num_seqs]`` float32, ``ln(min_p)`` or -inf when off.

    A row that is all -inf is left untouched (its threshold is -inf).
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    threshold = logits.amax(dim=-1) + log_min_p[idx_mapping]  # [rows]
    logits.masked_fill_(logits < threshold[:, None], float("-inf"))
