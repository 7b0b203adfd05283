"""Routed experts of an MoE block: two grouped GEMMs over the expert-sorted pairs.

``fused_experts`` computes, for each token ``t`` and its chosen experts ``e_j`` with weights
``w_j``: ``sum_j w_j * down_e(act(gate_e(x_t), up_e(x_t)))``. Launches: the sort
(:func:`moe_align`), the gate/up GEMM with the activation in its epilogue (intermediate rows
in sorted order), the down GEMM with the routing weight in its epilogue (rows back in pair
order), and the sum over each token's ``k`` rows (:func:`sum_pairs`). Each program of a GEMM
owns ``block_m`` sorted rows of one expert and one tile of that expert's weights, so at decode
(a block or two per expert) every expert's weights are read about once. Shapes depend only on
the token count: CUDA-graph capturable.

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
import triton.language as tl

from actors.engine.model.kernels import interpreted
from actors.engine.model.kernels.moe_align import moe_align
from actors.engine.model.kernels.moe_sum import sum_pairs, sum_pairs_torch
from actors.engine.model.kernels.moe_tiles import TileConfig, pick_config
from actors.engine.model.kernels.rounding import round_to


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


@triton.jit
def _tile(num_m, num_n, GROUP_M: tl.constexpr):
    """This program's (row block, column tile): ``GROUP_M`` consecutive row blocks (mostly
    one expert's) sweep all column tiles together, so their rows and that expert's weight
    tiles are read from DRAM about once and then hit in L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _block(block_expert_ptr, sorted_ptr, num_m, num_pairs, N, BM: tl.constexpr,
           BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's expert (-1: an unused block), its ``BM`` sorted rows with their pairs
    and which are real, and its ``BN`` output columns with which are in range."""
    pid_m, pid_n = _tile(num_m, tl.cdiv(N, BN), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    n = pid_n * BN + tl.arange(0, BN)
    return e, rows, pair, pair < num_pairs, pid_n, n, n < N


@triton.jit
def _activation(gate, up, alpha, limit, dt: tl.constexpr, SWIGLU: tl.constexpr):
    """The experts' activation of rounded ``gate`` / ``up`` tiles, rounded as torch's ops."""
    if SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = round_to(1.0 / (1.0 + tl.exp(-round_to(gate * alpha, dt))), dt)
        glu = round_to(gate * sig, dt)
        return round_to(round_to(up + 1.0, dt) * glu, dt)
    else:
        return round_to(round_to(gate / (1.0 + tl.exp(-gate)), dt) * up, dt)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["num_m", "num_pairs"])
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_m,
                    num_pairs, N, K, top_k, stride_xm, stride_we, stride_wn, stride_wk, up_offset,
                    n_step, stride_be, stride_om, alpha, limit, SWIGLU: tl.constexpr,
                    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr):
    e, rows, pair, valid, pid_n, n, n_ok = _block(block_expert_ptr, sorted_ptr, num_m, num_pairs,
                                                  N, BM, BN, GROUP_M)
    if e < 0:
        return
    tok = tl.where(valid, pair // top_k, 0).to(tl.int64)
    k = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + k[None, :]
    g_ptrs = w_ptr + e * stride_we + (n * n_step)[None, :] * stride_wn + k[:, None] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = _mma(a, g, acc_g, IEEE, UPCAST)
        acc_u = _mma(a, u, acc_u, IEEE, UPCAST)
        a_ptrs += BK
        g_ptrs += BK * stride_wk
        u_ptrs += BK * stride_wk
    dt = out_ptr.dtype.element_ty
    gate = round_to(acc_g, dt)
    up = round_to(acc_u, dt)
    if HAS_BIAS:
        bg = b_ptr + e * stride_be + n * n_step
        gate = round_to(gate + tl.load(bg, mask=n_ok, other=0.0).to(tl.float32)[None, :], dt)
        up = round_to(up + tl.load(bg + up_offset, mask=n_ok, other=0.0).to(tl.float32)[None, :],
                      dt)
    h = _activation(gate, up, alpha, limit, dt, SWIGLU)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, h.to(dt), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m", "num_pairs"])
def _gate_up_swapped_kernel(x_ptr, w_ptr, w_desc, b_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                            num_m, num_pairs, N, K, top_k, w_rows, stride_xm, stride_we,
                            stride_wn, stride_wk, up_offset, n_step, stride_be, stride_om, alpha,
                            limit, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                            IEEE: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """:func:`_gate_up_kernel` transposed: ``acc [BN, BM] = W x^T``, the weight tile the MMA's
    row operand (with ``TMA``, read through ``w_desc``, the weights as ``[E * w_rows, K]``)."""
    e, rows, pair, valid, pid_n, n, n_ok = _block(block_expert_ptr, sorted_ptr, num_m, num_pairs,
                                                  N, BM, BN, GROUP_M)
    if e < 0:
        return
    tok = tl.where(valid, pair // top_k, 0).to(tl.int64)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + tok[None, :] * stride_xm + k[:, None]
    g_ptrs = w_ptr + e * stride_we + (n * n_step)[:, None] * stride_wn + k[None, :] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    g_row = (e * w_rows + pid_n * BN).to(tl.int32)
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k < K - k0
        xt = tl.load(x_ptrs, mask=k_ok[:, None] & valid[None, :], other=0.0)
        if TMA:
            g = w_desc.load([g_row, k0])
            u = w_desc.load([g_row + up_offset, k0])
        else:
            g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = _mma(g, xt, acc_g, IEEE, UPCAST)
        acc_u = _mma(u, xt, acc_u, IEEE, UPCAST)
        x_ptrs += BK
        g_ptrs += BK * stride_wk
        u_ptrs += BK * stride_wk
    dt = out_ptr.dtype.element_ty
    gate = round_to(acc_g, dt)
    up = round_to(acc_u, dt)
    if HAS_BIAS:
        bg = b_ptr + e * stride_be + n * n_step
        gate = round_to(gate + tl.load(bg, mask=n_ok, other=0.0).to(tl.float32)[:, None], dt)
        up = round_to(up + tl.load(bg + up_offset, mask=n_ok, other=0.0).to(tl.float32)[:, None],
                      dt)
    h = _activation(gate, up, alpha, limit, dt, SWIGLU)
    out = out_ptr + rows[None, :].to(tl.int64) * stride_om + n[:, None]
    tl.store(out, h.to(dt), mask=n_ok[:, None] & valid[None, :])


@triton.jit(do_not_specialize=["num_m", "num_pairs"])
def _down_kernel(h_ptr, w_ptr, b_ptr, rw_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                 num_m, num_pairs, N, K, stride_hm, stride_we, stride_wn, stride_wk, stride_be,
                 stride_om, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr):
    e, rows, pair, valid, pid_n, n, n_ok = _block(block_expert_ptr, sorted_ptr, num_m, num_pairs,
                                                  N, BM, BN, GROUP_M)
    if e < 0:
        return
    k = tl.arange(0, BK)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + k[None, :]
    w_ptrs = w_ptr + e * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, w, acc, IEEE, UPCAST)
        a_ptrs += BK
        w_ptrs += BK * stride_wk
    dt = out_ptr.dtype.element_ty
    y = round_to(acc, dt)
    if HAS_BIAS:
        bias = tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        y = round_to(y + bias[None, :], dt)
    rw = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
    y = round_to(y * rw[:, None], dt)
    out = out_ptr + tl.where(valid, pair, 0)[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, y.to(dt), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m", "num_pairs"])
def _down_swapped_kernel(h_ptr, w_ptr, w_desc, b_ptr, rw_ptr, out_ptr, sorted_ptr,
                         block_expert_ptr, num_m, num_pairs, N, K, w_rows, stride_hm, stride_we,
                         stride_wn, stride_wk, stride_be, stride_om, HAS_BIAS: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr):
    """:func:`_down_kernel` transposed, as :func:`_gate_up_swapped_kernel`."""
    e, rows, pair, valid, pid_n, n, n_ok = _block(block_expert_ptr, sorted_ptr, num_m, num_pairs,
                                                  N, BM, BN, GROUP_M)
    if e < 0:
        return
    k = tl.arange(0, BK)
    h_ptrs = h_ptr + rows[None, :].to(tl.int64) * stride_hm + k[:, None]
    w_ptrs = w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :] * stride_wk
    w_row = (e * w_rows + pid_n * BN).to(tl.int32)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k < K - k0
        ht = tl.load(h_ptrs, mask=k_ok[:, None] & valid[None, :], other=0.0)
        if TMA:
            w = w_desc.load([w_row, k0])
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _mma(w, ht, acc, IEEE, UPCAST)
        h_ptrs += BK
        w_ptrs += BK * stride_wk
    dt = out_ptr.dtype.element_ty
    y = round_to(acc, dt)
    if HAS_BIAS:
        bias = tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        y = round_to(y + bias[:, None], dt)
    rw = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
    y = round_to(y * rw[None, :], dt)
    out = out_ptr + tl.where(valid, pair, 0)[None, :].to(tl.int64) * stride_om + n[:, None]
    tl.store(out, y.to(dt), mask=n_ok[:, None] & valid[None, :])


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
