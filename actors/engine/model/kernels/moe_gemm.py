"""Routed experts of an MoE block: two grouped GEMMs over the expert-sorted pairs.

``fused_experts`` computes, for each token ``t`` and its chosen experts ``e_j`` with weights
``w_j``: ``sum_j w_j * down_e(act(gate_e(x_t), up_e(x_t)))``. Launches: the sort
(:func:`moe_align`), the gate/up GEMM with the activation in its epilogue (intermediate rows
in sorted order), the down GEMM with the routing weight in its epilogue (rows back in pair
order), and the sum over each token's ``k`` rows (:func:`sum_pairs`). Each program of a GEMM
owns ``block_m`` sorted rows of one expert and one tile of that expert's weights, so at decode
(a block or two per expert) every expert's weights are read about once. Shapes depend only on
the token count: CUDA-graph capturable. The kernels are in
:mod:`~actors.engine.model.kernels.moe_gemm_kernels`; this module launches them.

Weight layouts are those of transformers' fused experts modules: ``ExpertLayout`` says
whether ``gate_up`` is ``[E, 2I, H]`` (``down`` ``[E, H, I]``) or transposed
(``[E, H, 2I]`` / ``[E, I, H]``, gpt-oss) and whether gate and up rows are the two halves
or interleaved. Results are rounded to the activations' dtype where the torch ops round
(after each projection, the bias, the activation's steps, the weighting), so they match
:func:`fused_experts_torch` to float32 sum-order effects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton

from actors.engine.model.kernels import interpreted
from actors.engine.model.kernels.moe_align import moe_align
from actors.engine.model.kernels.moe_gemm_kernels import (
    _down_kernel, _down_swapped_kernel, _gate_up_kernel, _gate_up_swapped_kernel)
from actors.engine.model.kernels.moe_sum import sum_pairs, sum_pairs_torch
from actors.engine.model.kernels.moe_tiles import TileConfig, pick_config


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """How one experts module stores and applies its weights.

    Attributes:
        transposed: ``gate_up`` is ``[E, H, 2I]`` and ``down`` ``[E, I, H]`` (x @ W).
        interleaved: gate and up are rows ``2j`` / ``2j + 1`` (else the first / second half).
        activation: "silu" (``silu(gate) * up``) or "swiglu_oai" (gpt-oss: gate clamped above
            at ``limit``, up to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``).
        alpha, limit: the swiglu_oai constants.
    """

    transposed: bool = False
    interleaved: bool = False
    activation: Literal["silu", "swiglu_oai"] = "silu"
    alpha: float = 1.702
    limit: float = 7.0


def _project(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ weight if transposed else torch.nn.functional.linear(x, weight)


def _activate(gate_up: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    if layout.interleaved:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if layout.activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=layout.limit)
    up = up.clamp(min=-layout.limit, max=layout.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * layout.alpha))


def fused_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, layout: ExpertLayout,
                        gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle (and the CPU path): one expert at a time, the torch ops of transformers'
    experts modules, each token's ``k`` weighted rows summed in float32."""
    tokens, top_k = ids.shape
    pairs = torch.zeros(tokens * top_k, x.shape[-1], dtype=x.dtype, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        pair = (flat == e).nonzero().squeeze(1)
        h = _project(x[pair // top_k], gate_up[e], layout.transposed)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        h = _project(_activate(h, layout), down[e], layout.transposed)
        if down_bias is not None:
            h = h + down_bias[e]
        pairs[pair] = (h * weights.reshape(-1)[pair, None]).to(x.dtype)
    return sum_pairs_torch(pairs, top_k)


def _strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output-row, reduction) strides of ``w`` as ``[E, N, K]``."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transposed else w.stride()


def _stages(stages: int, x: torch.Tensor) -> int:
    """A tile's pipeline stages for operands like ``x``: float32 ones (exact products) take
    twice the shared memory a stage, and two stages fit."""
    return min(stages, 2) if x.element_size() > 2 else stages


def tma_layout(w: torch.Tensor, layout: ExpertLayout) -> bool:
    """Whether ``w`` can be read through a tensor descriptor as ``[E * N, K]``: rows of
    contiguous reduction (neither transposed nor interleaved) in 16-byte aligned rows."""
    return (not layout.transposed and not layout.interleaved and w.is_contiguous()
            and (w.shape[-1] * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0)


def _descriptor(w: torch.Tensor, block_n: int, block_k: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])


def expert_gate_up(x: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
                   top_k: int, gate_up: torch.Tensor, layout: ExpertLayout,
                   gate_up_bias: torch.Tensor | None, config: TileConfig) -> torch.Tensor:
    """The activated gate/up rows ``[blocks * block_m, I]`` in sorted order (rows of padding
    left unwritten), of :func:`moe_align`'s ``sorted_pairs`` / ``block_expert``."""
    num_pairs = x.shape[0] * top_k
    inter = gate_up.shape[2] // 2 if layout.transposed else gate_up.shape[1] // 2
    hidden = x.shape[-1]
    bm, blocks = config.block_m, block_expert.numel()
    h = torch.empty(blocks * bm, inter, dtype=x.dtype, device=x.device)
    se, sn, sk = _strides(gate_up, layout.transposed)
    up_offset, n_step = (1, 2) if layout.interleaved else (inter, 1)
    bn, bk, warps, stages = config.gate_up
    grid = (blocks * triton.cdiv(inter, bn),)
    common = dict(SWIGLU=layout.activation == "swiglu_oai", HAS_BIAS=gate_up_bias is not None,
                  IEEE=x.dtype == torch.float32, UPCAST=interpreted(), BM=bm, BN=bn, BK=bk,
                  GROUP_M=config.group_m, num_warps=warps, num_stages=_stages(stages, x))
    bias = gate_up if gate_up_bias is None else gate_up_bias
    bias_stride = 0 if gate_up_bias is None else gate_up_bias.stride(0)
    if config.swap:
        tma = config.tma and tma_layout(gate_up, layout)
        desc = _descriptor(gate_up, bn, bk) if tma else gate_up
        _gate_up_swapped_kernel[grid](
            x, gate_up, desc, bias, h, sorted_pairs, block_expert, blocks, num_pairs, inter,
            hidden, top_k, 2 * inter, x.stride(0), se, sn, sk, up_offset, n_step, bias_stride,
            h.stride(0), float(layout.alpha), float(layout.limit), TMA=tma, **common)
    else:
        _gate_up_kernel[grid](
            x, gate_up, bias, h, sorted_pairs, block_expert, blocks, num_pairs, inter, hidden,
            top_k, x.stride(0), se, sn, sk, up_offset, n_step, bias_stride, h.stride(0),
            float(layout.alpha), float(layout.limit), **common)
    return h


def expert_down(h: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
                weights: torch.Tensor, down: torch.Tensor, layout: ExpertLayout,
                down_bias: torch.Tensor | None, config: TileConfig) -> torch.Tensor:
    """The weighted down projection of :func:`expert_gate_up`'s rows, ``[num_pairs, H]`` in
    pair order (``weights``: the flat ``[num_pairs]`` routing weights)."""
    num_pairs = weights.numel()
    hidden = down.shape[2] if layout.transposed else down.shape[1]
    inter = h.shape[1]
    bm, blocks = config.block_m, block_expert.numel()
    pairs = torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    se, sn, sk = _strides(down, layout.transposed)
    bn, bk, warps, stages = config.down
    grid = (blocks * triton.cdiv(hidden, bn),)
    common = dict(HAS_BIAS=down_bias is not None, IEEE=h.dtype == torch.float32,
                  UPCAST=interpreted(), BM=bm, BN=bn, BK=bk, GROUP_M=config.group_m,
                  num_warps=warps, num_stages=_stages(stages, h))
    bias = down if down_bias is None else down_bias
    bias_stride = 0 if down_bias is None else down_bias.stride(0)
    if config.swap:
        tma = config.tma and tma_layout(down, layout)
        desc = _descriptor(down, bn, bk) if tma else down
        _down_swapped_kernel[grid](
            h, down, desc, bias, weights, pairs, sorted_pairs, block_expert, blocks, num_pairs,
            hidden, inter, hidden, h.stride(0), se, sn, sk, bias_stride, pairs.stride(0),
            TMA=tma, **common)
    else:
        _down_kernel[grid](
            h, down, bias, weights, pairs, sorted_pairs, block_expert, blocks, num_pairs, hidden,
            inter, h.stride(0), se, sn, sk, bias_stride, pairs.stride(0), **common)
    return pairs


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, layout: ExpertLayout,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None,
                  config: TileConfig | None = None) -> torch.Tensor:
    """:func:`fused_experts_torch` in four launches.

    Args:
        x: ``[T, H]`` activations.
        ids: ``[T, k]`` chosen experts (int32/int64).
        weights: ``[T, k]`` their routing weights (any float dtype).
        gate_up, down: the experts' weights in ``layout`` (``x``'s dtype).
        layout: see :class:`ExpertLayout`.
        gate_up_bias, down_bias: ``[E, 2I]`` / ``[E, H]`` or None.
        config: the tiles; None picks them by the pairs per expert (:func:`pick_config`).

    Returns:
        ``[T, H]`` in ``x``'s dtype.

    Example:
        >>> y = fused_experts(x, ids, weights, gate_up, down, ExpertLayout())  # doctest: +SKIP
    """
    tokens, top_k = ids.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = weights.reshape(-1).contiguous()
    config = config or pick_config(tokens * top_k, gate_up.shape[0])
    sorted_pairs, block_expert = moe_align(ids, gate_up.shape[0], config.block_m)
    h = expert_gate_up(x, sorted_pairs, block_expert, top_k, gate_up, layout, gate_up_bias,
                       config)
    pairs = expert_down(h, sorted_pairs, block_expert, weights, down, layout, down_bias, config)
    return pairs if top_k == 1 else sum_pairs(pairs, top_k)
