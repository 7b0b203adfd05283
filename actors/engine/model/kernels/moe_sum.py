"""The last step of the routed experts: each token's ``k`` weighted expert rows summed.

``sum_pairs(pairs, top_k)`` reads ``pairs [T * k, H]`` (token ``t``'s rows ``t * k ... t * k +
k - 1``, as the down GEMM leaves them) and returns ``[T, H]``: the ``k`` values of a column
added in float32 and rounded once to the rows' dtype, as torch's ``view(T, k, H).sum(1)`` does
(its float32 sum order aside). One program takes one token and ``block`` columns and reads its
rows once: a decode step's sum at the read floor, with no CUDA-graph-unfriendly shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import round_to

__all__ = ["sum_pairs", "sum_pairs_torch"]


def sum_pairs_torch(pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """The oracle: ``[T * k, H] -> [T, H]``, summed in float32, rounded once."""
    return pairs.view(-1, top_k, pairs.shape[-1]).float().sum(1).to(pairs.dtype)


@triton.jit
def _sum_pairs_kernel(pairs_ptr, out_ptr, H, stride_p, stride_o, TOP_K: tl.constexpr,
                      K_P2: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, K_P2)
    ptrs = pairs_ptr + (t * TOP_K + j)[:, None] * stride_p + cols[None, :]
    rows = tl.load(ptrs, mask=(j < TOP_K)[:, None] & (cols < H)[None, :], other=0.0)
    dt = out_ptr.dtype.element_ty
    total = round_to(tl.sum(rows.to(tl.float32), axis=0), dt)
    tl.store(out_ptr + t * stride_o + cols, total.to(dt), mask=cols < H)


def sum_pairs(pairs: torch.Tensor, top_k: int, block: int = 1024) -> torch.Tensor:
    """:func:`sum_pairs_torch` in one launch.

    Args:
        pairs: ``[T * top_k, H]`` with unit column stride.
        top_k: rows per token.
        block: columns per program (a power of two).

    Returns:
        ``[T, H]`` in ``pairs``' dtype.
    """
    if pairs.stride(-1) != 1:
        raise ValueError("pairs: expected unit column stride")
    tokens, hidden = pairs.shape[0] // top_k, pairs.shape[1]
    out = torch.empty(tokens, hidden, dtype=pairs.dtype, device=pairs.device)
    block = min(block, triton.next_power_of_2(hidden))
    if tokens:
        _sum_pairs_kernel[(tokens, triton.cdiv(hidden, block))](
            pairs, out, hidden, pairs.stride(0), out.stride(0), TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k), BLOCK=block, num_warps=4)
    return out
