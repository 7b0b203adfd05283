"""The e4m3 arithmetic every FP8 piece shares, in plain torch (the kernels' oracles): the
constants, per-token quantization of activations, per-channel quantization of weights, and
the GPU generation that runs e4m3."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: the oldest CUDA compute capability with e4m3 tensor cores and conversions (Ada 8.9; Hopper 9.0)
MIN_CAPABILITY = (8, 9)
#: smallest scale (a row of zeros, e.g. CUDA-graph padding, quantizes to zeros, not NaN)
SCALE_FLOOR = 1e-12


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization: ``x`` ``[T, K]`` -> (``q`` ``[T, K]`` e4m3, ``scale`` ``[T, 1]``
    float32), ``scale = max(amax(|row|) / 448, SCALE_FLOOR)``,
    ``q = e4m3(clamp(x * (1 / scale)))`` (float32 math, the reciprocal once a row as the
    kernels take it, rounding to nearest even as torch casts)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # true divisions, as the kernels' (CUDA torch turns a division by a Python scalar into a
    # product with its reciprocal, which can differ in the last bit)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_FLOOR)
    inverse = torch.ones_like(scale) / scale
    q = (xf * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (the value an FP8 GEMM multiplies)."""
    return q.float() * scale


def quantize_weight_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of ``weight`` ``[N, K]``: ``(q [N, K], scale [N])``,
    the rows of ``quantize_rows_torch``."""
    q, scale = quantize_rows_torch(weight)
    return q, scale.reshape(-1)


def check_capability(device: torch.device, option: str, why: str = "Hopper, Ada") -> None:
    """Raises ``ValueError`` naming ``option`` (e.g. "engine.quantization: 'fp8'") and
    ``why`` when the CUDA ``device`` is older than :data:`MIN_CAPABILITY`."""
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"{option} needs a CUDA GPU of compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} ({why}), {device} "
            f"({torch.cuda.get_device_name(device)}) has {capability[0]}.{capability[1]}")
