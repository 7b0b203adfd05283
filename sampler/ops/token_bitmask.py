"""Pipeline step 2 (grammar): a per-row packed token bitmask — tokens whose bit is 0 become -inf.

The bitmask holds only the constrained rows: ``bitmask[j]`` is the mask of logits row
``mask_rows[j]``; bit ``t & 31`` of word ``t >> 5`` is 1 when token ``t`` is allowed. Tokens at
or past ``32 * bitmask.shape[1]`` count as not allowed (the mask covers the padded vocab).
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_token_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` bool, True where the bit of the token is set (False past the mask)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32,
                                                        device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool,
                      device=bits.device)
    return torch.cat([bits, pad], dim=1)


def pack_token_bitmask(allowed) -> torch.Tensor:
    """The inverse of :func:`unpack_token_bitmask`: ``[rows, vocab]`` bool (a tensor or an
    array) -> ``[rows, ceil(vocab / 32)]`` int32 packed masks."""
    allowed = torch.as_tensor(allowed, dtype=torch.bool)
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed
    bits = (padded.view(rows, words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        mask_rows: torch.Tensor) -> None:
    """Masks every token a constrained row's grammar does not allow (in place).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        bitmask: ``[num_masked, ceil(vocab / 32)]`` int32, one packed mask per constrained row.
        mask_rows: ``[num_masked]`` int64, the logits row of each mask (distinct).

    Example:
        >>> x = torch.zeros(2, 4)
        >>> apply_token_bitmask(x, torch.tensor([[0b0101]], dtype=torch.int32),
        ...                     torch.tensor([1]))
        >>> x
        tensor([[0., 0., 0., 0.],
                [0., -inf, 0., -inf]])
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == mask_rows.shape[0]
    if mask_rows.numel() == 0:
        return
    blocked = ~unpack_token_bitmask(bitmask, logits.shape[1])  # [num_masked, vocab]
    rows = logits.index_select(0, mask_rows)
    logits.index_copy_(0, mask_rows, rows.masked_fill_(blocked, float("-inf")))
