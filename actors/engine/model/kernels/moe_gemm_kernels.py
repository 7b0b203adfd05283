"""The Triton kernels of the routed experts' grouped GEMMs, launched by
:mod:`actors.engine.model.kernels.moe_gemm` (which documents what they compute): the gate/up
GEMM with the activation in its epilogue and the down GEMM with the routing weight in its
epilogue, each in two orientations (``_swapped``: the weights the MMA's row operand, read
through tensor descriptors where ``TMA``)."""

from __future__ import annotations

import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import round_to


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


@triton.jit
def _along_n(v, SWAP: tl.constexpr):
    """A ``[BN]`` vector of output columns broadcast over a tile's rows: ``[1, BN]``, or
    ``[BN, 1]`` in a swapped (``[BN, BM]``) tile."""
    if SWAP:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _along_m(v, SWAP: tl.constexpr):
    """A ``[BM]`` vector of rows broadcast over a tile's columns (as :func:`_along_n`)."""
    if SWAP:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _gate_up_out(acc_g, acc_u, b_ptr, e, stride_be, n, n_step, n_ok, up_offset, alpha, limit,
                 dt: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SWAP: tl.constexpr):
    """The gate/up GEMM's epilogue: both accumulators rounded, their biases added, the
    activation."""
    gate = round_to(acc_g, dt)
    up = round_to(acc_u, dt)
    if HAS_BIAS:
        bg = b_ptr + e * stride_be + n * n_step
        gate = round_to(gate + _along_n(tl.load(bg, mask=n_ok, other=0.0).to(tl.float32), SWAP),
                        dt)
        up = round_to(up + _along_n(tl.load(bg + up_offset, mask=n_ok, other=0.0)
                                    .to(tl.float32), SWAP), dt)
    return _activation(gate, up, alpha, limit, dt, SWIGLU)


@triton.jit
def _down_out(acc, b_ptr, rw_ptr, e, stride_be, n, n_ok, pair, valid, dt: tl.constexpr,
              HAS_BIAS: tl.constexpr, SWAP: tl.constexpr):
    """The down GEMM's epilogue: rounded, its bias added, times each row's routing weight."""
    y = round_to(acc, dt)
    if HAS_BIAS:
        bias = tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        y = round_to(y + _along_n(bias, SWAP), dt)
    rw = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
    return round_to(y * _along_m(rw, SWAP), dt)


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
    h = _gate_up_out(acc_g, acc_u, b_ptr, e, stride_be, n, n_step, n_ok, up_offset, alpha, limit,
                     dt, SWIGLU, HAS_BIAS, False)
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
    h = _gate_up_out(acc_g, acc_u, b_ptr, e, stride_be, n, n_step, n_ok, up_offset, alpha, limit,
                     dt, SWIGLU, HAS_BIAS, True)
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
    y = _down_out(acc, b_ptr, rw_ptr, e, stride_be, n, n_ok, pair, valid, dt, HAS_BIAS, False)
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
    y = _down_out(acc, b_ptr, rw_ptr, e, stride_be, n, n_ok, pair, valid, dt, HAS_BIAS, True)
    out = out_ptr + tl.where(valid, pair, 0)[None, :].to(tl.int64) * stride_om + n[:, None]
    tl.store(out, y.to(dt), mask=n_ok[:, None] & valid[None, :])
