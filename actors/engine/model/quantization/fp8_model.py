"""``quantization: fp8`` on a loaded model: the device check (before anything loads) and the
swap of every ``nn.Linear`` of the decoder layers for an :class:`Fp8Linear` (q/k/v/o,
gate/up/down, fused projections where a model has them). Embeddings, norms and the LM head
stay in the model dtype. A projection whose sizes ``_scaled_mm`` cannot take (not multiples of
16) stays bf16, as does one an FP8 checkpoint stored unquantized.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actors.engine.model.quantization.fp8_checkpoint import (
    Fp8CheckpointFormat,
    per_channel,
)
from actors.engine.model.quantization.fp8_linear import Fp8Linear
from actors.engine.model.quantization.fp8_math import MIN_CAPABILITY, check_capability

logger = logging.getLogger(__name__)

def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """Raises ``ValueError`` unless FP8 can run on ``device`` with ``dtype`` activations."""
    if device.type != "cuda":
        raise ValueError(f"engine.quantization: 'fp8' needs a CUDA GPU of compute capability "
                         f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Hopper, Ada), the "
                         f"engine's device is {device}")
    check_capability(device, "engine.quantization: 'fp8'")
    if dtype != torch.bfloat16:
        raise ValueError(f"engine.dtype: quantization 'fp8' computes in bfloat16, got {dtype}")


def decoder_linears(model: torch.nn.Module, base_model: torch.nn.Module
                    ) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """``(full name, parent, attribute, linear)`` of every ``nn.Linear`` in the decoder
    layers (``base_model.layers``)."""
    layers = getattr(base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError("engine.quantization: 'fp8' needs the decoder layers at "
                         f"{type(base_model).__name__}.layers (a ModuleList)")
    prefix = next(name for name, module in model.named_modules() if module is layers)
    found = []
    for name, parent in layers.named_modules(prefix=prefix):
        for attr, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                found.append((f"{name}.{attr}", parent, attr, child))
    return found


@torch.no_grad()
def quantize_decoder(model: torch.nn.Module, base_model: torch.nn.Module, *,
                     fmt: Fp8CheckpointFormat | None = None,
                     scales: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Swaps the decoder projections for FP8 layers in place, quantizing bf16 weights per
    output channel, or taking an FP8 checkpoint's values (``fmt`` and ``scales``: then the
    weights transformers loaded hold the e4m3 values). Returns a summary for ``info()``."""
    summary: dict[str, Any] = {"method": "fp8", "checkpoint": fmt.method if fmt else None,
                               "fp8_layers": 0, "kept": [], "requantized_blocks": 0}
    for name, parent, attr, linear in decoder_linears(model, base_model):
        if linear.in_features % 16 or linear.out_features % 16:
            summary["kept"].append(name)
            continue
        dtype = linear.weight.dtype
        if fmt is None:
            layer = Fp8Linear.from_linear(linear, out_dtype=dtype)
        else:
            scale = (scales or {}).get(name)
            if scale is None:  # stored unquantized by the checkpoint
                summary["kept"].append(name)
                continue
            q, channel, exact = per_channel(linear.weight, scale, fmt.block, name)
            layer = Fp8Linear(linear.in_features, linear.out_features,
                              bias=linear.bias is not None, device=linear.weight.device,
                              out_dtype=dtype)
            layer.load_quantized(q, channel)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
            summary["requantized_blocks"] += not exact
        setattr(parent, attr, layer)
        summary["fp8_layers"] += 1
    if not summary["fp8_layers"]:
        raise ValueError("engine.quantization: 'fp8' found no decoder projection to quantize")
    logger.info("fp8: %d decoder projections in e4m3 (%s), %d kept in %s%s",
                summary["fp8_layers"], fmt.method if fmt else "quantized at load",
                len(summary["kept"]), next(base_model.parameters()).dtype,
                f", e.g. {summary['kept'][0]}" if summary["kept"] else "")
    return summary
