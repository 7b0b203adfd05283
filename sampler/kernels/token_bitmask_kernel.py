"""Grammar masks in Triton: a tile of logits loses the tokens its row's packed bitmask clears.

Tile function :func:`_bitmask_tile` is what a kernel that reads a row's logits calls on each
tile (under its ``HAS_GRAMMAR`` constexpr, so steps without constrained rows compile it out):
it reads one int32 word per 32 tokens (1/32 of the logits' bytes) and turns every token
whose bit is 0 into -inf. :func:`_bitmask_lanes` does the same on ``[R, VEC]`` tiles with
one word load a lane instead of one a token (:func:`_lane_bits`, also the penalties' touched
tokens). :func:`apply_token_bitmask_triton` is the standalone op with the
signature of :func:`sampler.ops.token_bitmask.apply_token_bitmask`, its torch oracle: it
writes -inf over the masked tokens of the logits (the launcher's pass for a step whose kernels
then read no mask). Each mask word is read once for its 32 tokens and the logits tile is read
and written back whole (a store of only the masked tokens cannot be vectorized).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bitmask_tile(x, offs, vmask, bits_ptr, mrow, W):
    """``x`` (a float32 tile of one row, token ids ``offs``, ``vmask`` inside the vocab) with
    every token the row's mask clears set to -inf; ``mrow`` is the row's mask index in
    ``bits_ptr`` (``[num_masked, W]`` int32), -1 for an unconstrained row (unchanged)."""
    if mrow >= 0:
        x = tl.where(_allowed(bits_ptr, mrow, W, offs, vmask), x, float("-inf"))
    return x


@triton.jit
def _allowed(bits_ptr, mrow, W, offs, vmask):
    """Whether mask ``mrow`` (of ``bits_ptr``, ``W`` words a mask) allows each token ``offs``
    (False outside ``vmask`` and past its words)."""
    words = tl.load(bits_ptr + mrow.to(tl.int64) * W + offs // 32,
                    mask=vmask & (offs < W * 32), other=0)
    return ((words >> (offs % 32)) & 1) != 0


@triton.jit
def _lane_bits(bits_row_ptr, first, lim, VEC: tl.constexpr):
    """The bits of a packed bitmask row (int32 words, bit ``t & 31`` of word ``t >> 5`` for
    token ``t``) for an ``[R, VEC]`` tile whose lane ``r`` holds the ``VEC`` tokens from
    ``first[r]`` (``[R]``, each a multiple of ``VEC``; VEC divides 32, so a lane's tokens lie
    in one word): one word is read a lane, not a token. Lanes from ``lim`` on read no word
    (all their bits are 0)."""
    tl.static_assert(32 % VEC == 0, "a lane's tokens must lie in one 32-bit word")
    words = tl.load(bits_row_ptr + first // 32, mask=first < lim, other=0)
    shift = (first % 32)[:, None] + tl.arange(0, VEC)[None, :]
    return ((words[:, None] >> shift) & 1) != 0


@triton.jit
def _bitmask_lanes(x, first, lim, bits_ptr, mrow, W, VEC: tl.constexpr):
    """:func:`_bitmask_tile` of an ``[R, VEC]`` tile of lanes from ``first`` (as
    :func:`_lane_bits`)."""
    if mrow >= 0:
        allowed = _lane_bits(bits_ptr + mrow.to(tl.int64) * W, first, lim, VEC)
        x = tl.where(allowed, x, float("-inf"))
    return x


@triton.jit
def _mask_row(grow_ptr, row, HAS_GRAMMAR: tl.constexpr):
    """The mask index of logits ``row`` (``grow_ptr``: ``[rows]`` int32), -1 without masks."""
    mrow = -1
    if HAS_GRAMMAR:
        mrow = tl.load(grow_ptr + row)
    return mrow


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_row, V, bits_ptr, W, rows_ptr,
                                WORDS: tl.constexpr):
    """Sets to -inf every token mask ``j`` clears in its logits row: a ``[WORDS, 32]`` tile
    of tokens a program, each mask word read once for its 32 tokens, the logits read and
    written back whole."""
    j = tl.program_id(0)  # mask index
    w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    words = tl.load(bits_ptr + j.to(tl.int64) * W + w, mask=w < W, other=0)
    bit = tl.arange(0, 32)
    allowed = ((words[:, None] >> bit[None, :]) & 1) != 0
    offs = w[:, None] * 32 + bit[None, :]
    vmask = offs < V
    row = tl.load(rows_ptr + j)
    ptrs = logits_ptr + row * stride_row + offs
    x = tl.load(ptrs, mask=vmask)
    y = tl.where(allowed, x.to(tl.float32), float("-inf"))
    tl.store(ptrs, y.to(x.dtype), mask=vmask)  # (exact: a float32 round trip)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               mask_rows: torch.Tensor, block: int = 1024) -> None:
    """Masks every token a constrained row's grammar does not allow (in place); the same
    contract as :func:`sampler.ops.token_bitmask.apply_token_bitmask`.

    Args:
        logits: ``[rows, vocab]`` float32, bf16 or fp16, vocab stride 1, modified in place.
        bitmask: ``[num_masked, ceil(vocab / 32)]`` int32, contiguous.
        mask_rows: ``[num_masked]`` int64, the logits row of each mask.
        block: tokens a program covers (a multiple of 32).
    """
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert logits.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    assert mask_rows.shape == (bitmask.shape[0],)
    rows, vocab = logits.shape
    if bitmask.shape[0] == 0 or vocab == 0:
        return
    assert block % 32 == 0
    grid = (bitmask.shape[0], triton.cdiv(vocab, block))
    _apply_token_bitmask_kernel[grid](logits, logits.stride(0), vocab, bitmask,
                                      bitmask.shape[1], mask_rows, WORDS=block // 32)
