"""Pipeline step 3: bad words.

For each word of L tokens, if the last L-1 *output* tokens of the row equal the word's first
L-1 tokens, the word's last token becomes -inf. Single-token words are always banned; a row
with fewer than L-1 output tokens matches no word of length L.

Layout: each slot keeps its words right-aligned in ``[max_num_seqs, max_words, max_len]``
(``word_tokens``), the last token in the last column, left padding ``PAD_ANY`` (matches
anything) and unused word rows entirely ``PAD_ANY`` with ``word_lens == 0``. The slot's recent
output tokens sit in ``recent_tokens [max_num_seqs, window]`` (most recent last; unknown
positions are -1, which matches no token).
"""

from __future__ import annotations

import torch

PAD_ANY = -2


def apply_bad_words(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    word_tokens: torch.Tensor,
    word_lens: torch.Tensor,
    recent_tokens: torch.Tensor,
) -> None:
    """Bans the last token of every bad word whose prefix was just generated (in place).

    Args:
        logits: ``[rows, vocab]`` float32, modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        word_tokens: ``[max_num_seqs, max_words, max_len]`` int64, right-aligned words.
        word_lens: ``[max_num_seqs, max_words]`` int64, 0 for unused word rows.
        recent_tokens: ``[max_num_seqs, window]`` int64 with ``window >= max_len - 1``.
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    words = word_tokens[idx_mapping]  # [rows, W, L]
    lens = word_lens[idx_mapping]  # [rows, W]
    max_len = words.shape[-1]
    last = words[..., -1]  # [rows, W]
    if max_len > 1:
        prefix = words[..., :-1]  # [rows, W, L-1]
        window = recent_tokens[idx_mapping][:, None, recent_tokens.shape[1] - (max_len - 1):]
        matched = ((prefix == window) | (prefix == PAD_ANY)).all(dim=-1)
    else:
        matched = torch.ones_like(last, dtype=torch.bool)
    matched &= lens > 0
    ban = torch.where(matched, float("-inf"), float("inf")).to(logits.dtype)
    logits.scatter_reduce_(1, last.clamp_min(0), ban, reduce="amin")
