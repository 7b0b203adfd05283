"""The e4m3 arithmetic every FP8 piece shares, in plain torch (the kernels' oracles): the
constants, per-token quantization of activations, per-channel quantization of weights."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: smallest scale (a row of zeros, e.g. CUDA-graph padding, quantizes to zeros, not NaN)
SCALE_FLOOR = 1e-12


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization: ``x`` ``[T, K]`` -> (``q`` ``[T, K]`` e4m3, ``scale`` ``[T, 1]``
    float32), ``scale = max(amax(|row|) / 448, SCALE_FLOOR)``, ``q = e4m3(clamp(x / scale))``
    (float32 math, rounding to nearest even as torch casts)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(SCALE_FLOOR)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (the value an FP8 GEMM multiplies)."""
    return q.float() * scale


def quantize_weight_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of ``weight`` ``[N, K]``: ``(q [N, K], scale [N])``,
    the rows of ``quantize_rows_torch``."""
    q, scale = quantize_rows_torch(weight)
    return q, scale.reshape(-1)
