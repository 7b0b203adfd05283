"""The FP8 projection: an ``nn.Linear`` stand-in holding an e4m3 weight ``[N, K]`` with one
float32 scale per output channel, computing ``x @ W^T`` as
``torch._scaled_mm(q, W_q^T, scale_a=s_x [T, 1], scale_b=s_w [1, N])`` with ``x`` quantized
per token.

The input's quantization comes with the input when the kernel that produced it made one (the
fused RMSNorm attaches ``(q, scale)`` to its bf16 output under ``FP8_INPUT``: the norm's
consumers, q/k/v or gate/up, use it as is); otherwise the layer quantizes its input (the
standalone kernel on CUDA, the torch oracle elsewhere: CPU runs are the tests' emulation).
The weight keeps the HF parameter name (``<module>.weight``), so ``update_weights`` finds it
and re-quantizes bf16 tensors into its storage in place (``load_weight``).
"""

from __future__ import annotations

import torch

from actors.engine.model.quantization.fp8_math import (
    FP8_DTYPE,
    quantize_rows_torch,
    quantize_weight_torch,
)

#: CUDA GEMMs accumulate in the tensor cores' own precision, without promoting partial sums to
#: float32 along K (the FP8 GEMM schedule vLLM's kernels use; see docs/fp8.md for its drift)
FAST_ACCUM = True

#: attribute of a bf16 activation that carries its per-token quantization ``(q, scale)``
FP8_INPUT = "_fp8_input"


def attach_fp8_input(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Marks ``out`` (the bf16 tensor a producer returns) with its quantization ``q [T, K]``,
    ``scale [T, 1]`` for the FP8 layers that read it; returns ``out``."""
    setattr(out, FP8_INPUT, (q, scale))
    return out


def fp8_input(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token quantization ``(q [T, K], scale [T, 1])`` of ``x [..., K]``: the one
    its producer attached, else made here (the standalone kernel on CUDA, the torch oracle
    elsewhere)."""
    attached = getattr(x, FP8_INPUT, None)
    if attached is not None:
        return attached
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    if rows.is_cuda:
        from actors.engine.model.kernels.fp8_quant import quantize_rows

        return quantize_rows(rows)
    return quantize_rows_torch(rows)


def fp8_matmul(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``(q * scale) @ (weight * weight_scale)^T (+ bias)``: e4m3 rows ``[T, K]`` with
    ``[T, 1]`` scales, an e4m3 weight ``[N, K]`` with ``[1, N]`` scales -> ``[T, N]``."""
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale,
                           out_dtype=out_dtype, use_fast_accum=FAST_ACCUM and q.is_cuda)
    if bias is not None:
        out += bias
    return out


class Fp8Linear(torch.nn.Module):
    """``y = x @ W^T (+ bias)`` with ``W`` in e4m3 and per-channel scales (see the module
    docstring). Build it with :meth:`from_linear`.

    Attributes:
        weight: ``[N, K]`` float8_e4m3fn parameter (the HF name's tensor).
        weight_scale: ``[1, N]`` float32 buffer (not in the state dict: derived).
        bias: ``[N]`` parameter of ``out_dtype``, or None.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 device: torch.device, out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.weight = torch.nn.Parameter(
            torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(1, out_features, device=device),
                             persistent=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=out_dtype,
                                                   device=device),
                                       requires_grad=False) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: torch.nn.Linear, out_dtype: torch.dtype = torch.bfloat16
                    ) -> Fp8Linear:
        """The FP8 layer of ``linear``'s weight, quantized here (``quantize_weight_torch``)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=linear.weight.device, out_dtype=out_dtype)
        layer.load_weight(linear.weight)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Quantizes a floating-point ``[N, K]`` weight into this layer's storage in place."""
        q, scale = quantize_weight_torch(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(scale[None])

    @torch.no_grad()
    def load_quantized(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Takes an already quantized weight: e4m3 values ``q [N, K]`` (any dtype holding
        them exactly) and their per-channel scale (``[N]``, ``[N, 1]`` or one value)."""
        self.weight.copy_(q.to(self.weight.device, FP8_DTYPE))
        self.weight_scale.copy_(scale.to(self.weight_scale.device, torch.float32)
                                .reshape(1, -1).expand_as(self.weight_scale))

    def dequantized_weight(self) -> torch.Tensor:
        """``W_q * s_w`` in float32 ``[N, K]`` (what the layer multiplies by)."""
        return self.weight.float() * self.weight_scale.t()

    def matmul(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` e4m3 rows with ``[T, 1]`` scales -> ``[T, N]`` in ``out_dtype``."""
        return fp8_matmul(q, scale, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(*fp8_input(x, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=float8_e4m3fn per-channel")
