"""Pipeline step 2: ``allowed_token_ids`` — every id outside the allowed set becomes -inf."""

from __future__ import annotations

import torch


def apply_allowed_token_ids(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    has_allowed: torch.Tensor,
    allowed_mask: torch.Tensor,
) -> None:
    """Masks every token a row's request does not allow (in place).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        has_allowed: ``[max_num_seqs]`` bool, whether the slot's request restricts its ids.
        allowed_mask: ``[max_num_seqs, vocab]`` bool, True for the allowed ids of the slot
            (ignored for slots without a restriction).

    Example:
        >>> x = torch.zeros(1, 4)
        >>> apply_allowed_token_ids(x, torch.tensor([0]), torch.tensor([True]),
        ...                         torch.tensor([[True, False, True, False]]))
        >>> x
        tensor([[0., -inf, 0., -inf]])
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    blocked = ~allowed_mask[idx_mapping] & has_allowed[idx_mapping][:, None]  # [rows, vocab]
    logits.masked_fill_(blocked, float("-inf"))
