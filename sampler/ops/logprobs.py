"""Logprob outputs (docs/sampler.md §3): sampled value, rank and sorted top-k of a value tensor.

The value tensor holds, per row, the values of the row's ``logprobs_mode`` (built by the
pipeline). Ranks count strictly greater values: ``rank = 1 + #{t : value_t > value_sampled}``.
Top-k entries are sorted by value descending, ties by lower id. The order is exact: each value
is mapped to an order-preserving int32 (-0.0 folded onto +0.0), and the int64 key
``int32 << 32 | (2**32 - 1 - id)`` is unique per token, so ``topk`` on the keys is
deterministic on every device.
"""

from __future__ import annotations

import torch

OFF = -2  # per-slot ``logprobs`` value meaning "not requested"


def _order_keys(values: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` float32 -> unique int64 keys, descending value then ascending id."""
    bits = (values + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ids = torch.arange(values.shape[1], device=values.device, dtype=torch.int64)
    return (ordered * (1 << 32)) | (0xFFFFFFFF - ids)


def compute_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row, descending, ties broken by the lower id.

    Args:
        values: ``[rows, vocab]`` float32 (no NaN).
        k: number of entries, ``0 <= k <= vocab``.

    Returns:
        ``(ids, vals)``: ``[rows, k]`` int64 and ``[rows, k]`` float32.

    Example:
        >>> compute_topk(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), 3)[0]
        tensor([[1, 2, 3]])
    """
    if not 0 <= k <= values.shape[1]:
        raise ValueError(f"k: must be in [0, {values.shape[1]}], got {k}")
    keys = _order_keys(values)
    top = keys.topk(k, dim=-1, sorted=True).values if k < values.shape[1] else \
        keys.sort(dim=-1, descending=True).values
    ids = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    return ids, values.gather(1, ids)


def compute_logprob_outputs(
    values: torch.Tensor,
    token_ids: torch.Tensor,
    num_logprobs: torch.Tensor,
    max_num_logprobs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sampled-token value, rank and padded top-k for every row.

    Args:
        values: ``[rows, vocab]`` float32, each row in its logprobs mode.
        token_ids: ``[rows]`` int64, the token whose value and rank are reported.
        num_logprobs: ``[rows]`` int64 per row: ``OFF`` (-2) not requested, 0 the token only,
            k > 0 top-k too, -1 the whole vocab.
        max_num_logprobs: K, the width of the top-k output (host-side: the largest request
            of the batch, the vocab size for -1); 0 returns no top-k tensors.

    Returns:
        ``(logprobs, ranks, topk_ids, topk_values)``: ``[rows]`` float32 (NaN for rows that
        did not ask), ``[rows]`` int64 (0 for rows that did not ask), and ``[rows, K]`` int64 /
        float32 padded with -1 / -inf past each row's own k (None when K is 0).
    """
    rows, vocab = values.shape
    sampled = values.gather(1, token_ids[:, None])  # [rows, 1]
    requested = num_logprobs != OFF
    logprobs = torch.where(requested, sampled[:, 0], float("nan"))
    ranks = torch.where(requested, 1 + (values > sampled).sum(dim=-1), 0)
    if max_num_logprobs <= 0:
        return logprobs, ranks, None, None
    ids, vals = compute_topk(values, max_num_logprobs)
    width = torch.where(num_logprobs == -1, vocab, num_logprobs.clamp_min(0))  # [rows]
    pad = torch.arange(max_num_logprobs, device=values.device)[None, :] >= width[:, None]
    return logprobs, ranks, ids.masked_fill(pad, -1), vals.masked_fill(pad, float("-inf"))
