"""Pipeline steps 10–11: top-k, then top-p on the distribution renormalised after top-k.

Kept-set rules (every backend agrees on them):

- top-k keeps t where ``logit_t >= v_k``, the k-th largest value of the row: all tokens tied
  with the k-th are kept. ``k <= 0`` or ``k >= vocab`` is off.
- top-p keeps t iff the probability mass of the tokens *strictly* more probable than t is
  ``< p``; the top token is always kept and a tie group at the boundary is kept whole.
  ``p >= 1`` is off.

top-p arithmetic (float32): ``s`` = the row sorted descending after top-k (dropped entries
-inf), ``e_i = exp(s_i - s_0)``, ``c = cumsum(e)``, ``total = c[-1]``; the mass strictly above
``s_i``'s tie group is ``c[j-1]`` (0 for ``j = 0``) where j is the group's first index, so the
kept prefix is the ``count = #{i : c[i-1] < p * total}`` first entries extended to their tie
group: keep t iff ``logit_t >= s[count - 1]``. A row that is all -inf is left untouched.
"""

from __future__ import annotations

import torch


def _top_k_threshold(values: torch.Tensor, k: torch.Tensor, k_active: torch.Tensor) -> torch.Tensor:
    """``values`` sorted descending ``[rows, n]``; returns ``[rows, 1]`` thresholds."""
    index = (k.clamp(1, values.shape[1]) - 1)[:, None]
    kth = values.gather(1, index)
    return torch.where(k_active[:, None], kth, float("-inf"))


def compute_top_p_threshold(sorted_desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p threshold of rows already sorted in descending order.

    Args:
        sorted_desc: ``[rows, vocab]`` float32, each row sorted descending (-inf = dropped).
        top_p: ``[rows]`` float32 in (0, 1].

    Returns:
        ``[rows, 1]`` float32: keep t iff ``logit_t >= threshold`` (-inf for all -inf rows).
    """
    top = sorted_desc[:, :1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    cumulative = torch.cumsum(torch.exp(sorted_desc - top), dim=-1)  # [rows, vocab]
    limit = top_p[:, None] * cumulative[:, -1:]  # [rows, 1]
    count = (limit > 0).to(torch.int64)[:, 0] + (cumulative[:, :-1] < limit).sum(dim=-1)
    return sorted_desc.gather(1, (count - 1).clamp_min(0)[:, None])


def apply_top_k_top_p(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    do_top_k: bool = True,
    do_top_p: bool = True,
    max_top_k: int | None = None,
) -> None:
    """Masks the tokens outside each row's top-k / top-p set (in place).

    Args:
        logits: ``[rows, vocab]`` float32 (after temperature and min-p), modified in place.
        idx_mapping: ``[rows]`` int64, the slot of each row.
        top_k: ``[max_num_seqs]`` int64; ``<= 0`` or ``>= vocab`` means off.
        top_p: ``[max_num_seqs]`` float32 in (0, 1]; 1 means off.
        do_top_k, do_top_p: host-side predicates; a False one skips that filter entirely.
        max_top_k: an upper bound on the active k of the batch (host-side); when given and
            top-p is off, a partial ``topk`` replaces the full sort.

    Example:
        >>> x = torch.tensor([[3.0, 1.0, 3.0, 2.0]])
        >>> apply_top_k_top_p(x, torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))
        >>> x
        tensor([[3., -inf, 3., -inf]])
    """
    assert logits.dtype == torch.float32 and logits.dim() == 2
    if not (do_top_k or do_top_p) or logits.shape[0] == 0:
        return
    vocab = logits.shape[1]
    k = top_k[idx_mapping].to(torch.int64)
    k_active = (k > 0) & (k < vocab)
    p = top_p[idx_mapping]
    if not do_top_p:
        if max_top_k is not None and 0 < max_top_k < vocab:
            values = logits.topk(max_top_k, dim=-1, sorted=True).values
        else:
            values = logits.sort(dim=-1, descending=True).values
        threshold = _top_k_threshold(values, k, k_active)
    else:
        values = logits.sort(dim=-1, descending=True).values  # [rows, vocab]
        threshold = _top_k_threshold(values, k, k_active)
        if do_top_k:
            values.masked_fill_(values < threshold, float("-inf"))
        p_threshold = compute_top_p_threshold(values, p)
        threshold = torch.where((p < 1)[:, None], torch.maximum(threshold, p_threshold), threshold)
    logits.masked_fill_(logits < threshold, float("-inf"))
