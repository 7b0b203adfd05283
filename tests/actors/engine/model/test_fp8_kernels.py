"""The FP8 quantization kernels (per-token quantize, RMSNorm + quantize, SiLU-mul + quantize)
against their torch oracles (TRITON_INTERPRET=1 on CPU, the GPU otherwise).

The interpreter stores float8_e4m3fn tensors; its own float32 -> e4m3 cast rounds ties away
from zero, which is why the kernels round by bits first: the values compared here are the
stored e4m3 tensors themselves, not a float32 stand-in.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actors.engine.model.kernels.fp8_quant import (
    FP8_MAX,
    SCALE_FLOOR,
    dequantize_rows,
    quantize_rows,
    quantize_rows_torch,
)
from actors.engine.model.kernels.rms_norm import (
    rms_norm,
    rms_norm_fp8,
    rms_norm_fp8_torch,
)
from actors.engine.model.kernels.silu_mul import silu_mul_fp8, silu_mul_fp8_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXACT = DEVICE.type == "cpu"  # the GPU's exp / sum order may move a value by one bf16 ulp


def _assert_quantized_equal(q, scale, q_ref, scale_ref):
    assert q.dtype == q_ref.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape
    assert scale.dtype == torch.float32 and scale.shape == scale_ref.shape == (q.shape[0], 1)
    if EXACT:
        assert torch.equal(scale, scale_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # bit for bit
    else:
        torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0)
        deq, ref = dequantize_rows(q, scale), dequantize_rows(q_ref, scale_ref)
        assert float((deq - ref).abs().max()) <= float(scale_ref.max()) * 32  # one e4m3 step
        assert (q.float() != q_ref.float()).float().mean() < 0.01


def test_oracle_scale_math_and_round_trip():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [896.0, 1.0, -3.0, 0.0]])
    q, scale = quantize_rows_torch(x)
    assert torch.equal(scale.flatten(), torch.tensor([4.0 / FP8_MAX, SCALE_FLOOR, 2.0]))
    assert q.dtype == torch.float8_e4m3fn
    assert q[0].float().tolist() == [112.0, -224.0, 56.0, 448.0]  # x / s, exact here
    assert q[1].float().abs().sum() == 0  # a zero row: zeros, no NaN
    assert q[2].float().tolist() == [448.0, 0.5, -1.5, 0.0]
    torch.testing.assert_close(dequantize_rows(q, scale), x, rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: the round trip is within 2^-4 of each row's amax
    y = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]
    err = (dequantize_rows(*quantize_rows_torch(y)) - y).abs().amax(-1)
    assert (err <= y.abs().amax(-1) / 16).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (5, 96), (3, 896), (2, 5000), (2, 16500)])
def test_quantize_rows_equals_torch(dtype, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(*shape, generator=gen) * 3).to(DEVICE, dtype)
    x[-1] = 0  # the floor
    _assert_quantized_equal(*quantize_rows(x), *quantize_rows_torch(x))


def test_quantize_rows_rounds_ties_to_even_as_torch_casts():
    # a scale of exactly 1 (amax 448): each value is rounded as it is; ties of normals
    # (1.0625, 17, 19, 232) and of subnormals (3 * 2^-10, 2^-10), the normal boundary
    values = [448.0, 1.0625, 17.0, 19.0, -17.0, 232.0, 3 * 2**-10, 5 * 2**-10, 2**-10,
              -(2**-11), 0.0146484375, 0.0152587890625, 0.0]
    x = torch.tensor([values], device=DEVICE)
    q, scale = quantize_rows(x)
    assert scale.item() == 1.0
    want = torch.tensor([values]).to(torch.float8_e4m3fn)
    assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8))  # -0.0 too
    sweep = torch.linspace(-FP8_MAX, FP8_MAX, 100_001, device=DEVICE)[None]
    assert torch.equal(quantize_rows(sweep)[0].view(torch.uint8),
                       quantize_rows_torch(sweep)[0].view(torch.uint8))


def test_quantize_rows_takes_a_row_strided_view_and_refuses_others():
    x = torch.randn(4, 200, device=DEVICE, dtype=torch.bfloat16)[:, :96]
    _assert_quantized_equal(*quantize_rows(x), *quantize_rows_torch(x))
    assert quantize_rows(x[:0])[0].shape == (0, 96)
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        quantize_rows(x.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 896), (21, 128)])
def test_rms_norm_fp8_equals_torch(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(2, rows, hidden, generator=gen) * 3).to(DEVICE, dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    out, q, scale = rms_norm_fp8(x, w, 1e-6)
    _, q_ref, scale_ref = rms_norm_fp8_torch(x, w, 1e-6)
    assert out.shape == x.shape and q.shape == (2 * rows, hidden)
    assert torch.equal(out, rms_norm(x, w, 1e-6))  # the plain kernel's output, unchanged
    # the norm may differ from torch's in the last bit (test_fused_layers); the quantization
    # of the output the kernel stored is the oracle's, bit for bit: fused == unfused
    q_own, scale_own = quantize_rows_torch(out.reshape(-1, hidden))
    assert torch.equal(scale, scale_own)
    assert torch.equal(q.view(torch.uint8), q_own.view(torch.uint8))
    torch.testing.assert_close(scale, scale_ref, rtol=2 * torch.finfo(dtype).eps, atol=0)
    deq, ref = dequantize_rows(q, scale), dequantize_rows(q_ref, scale_ref)
    assert float((deq - ref).abs().max()) <= float(scale_ref.max()) * 32  # one e4m3 step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (5, 200), (3, 4864), (2, 9000), (2, 16500)])
def test_silu_mul_fp8_equals_torch(dtype, shape):
    gen = torch.Generator().manual_seed(shape[1] + 1)
    gate = (torch.randn(*shape, generator=gen) * 4).to(DEVICE, dtype)
    up = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    _assert_quantized_equal(*silu_mul_fp8(gate, up), *silu_mul_fp8_torch(gate, up))


@pytest.mark.parametrize("inner", [200, 16500])  # one program a row; two kernels
def test_silu_mul_fp8_reads_the_halves_of_one_gate_up_output_in_place(inner):
    gen = torch.Generator().manual_seed(inner)
    gate_up = (torch.randn(3, 2 * inner, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    gate, up = gate_up[:, :inner], gate_up[:, inner:]
    assert gate.stride(0) == 2 * inner
    _assert_quantized_equal(*silu_mul_fp8(gate, up),
                            *silu_mul_fp8_torch(gate.contiguous(), up.contiguous()))


def test_silu_mul_fp8_refuses_mismatched_inputs():
    a = torch.randn(3, 32, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gate, up"):
        silu_mul_fp8(a, a[:2])
    with pytest.raises(ValueError, match="gate, up"):
        silu_mul_fp8(a, a.float())
