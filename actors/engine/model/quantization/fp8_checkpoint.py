"""Which checkpoints ``quantization: fp8`` loads, and the scales of those already in FP8.

A checkpoint without a ``quantization_config`` (bf16/fp16/fp32 weights) is quantized at load.
One with ``quantization_config`` loads directly when its format is one of:

- ``quant_method: "fp8"`` (transformers' fine-grained FP8, as in DeepSeek-V3 / Qwen3-FP8):
  e4m3 weights with block-wise ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]``
  (``weight_block_size: [bn, bk]``), ``W = q * s`` per block;
- ``quant_method: "compressed-tensors"`` (``format`` float-quantized / naive-quantized): 8-bit
  float weights of strategy ``channel`` (``weight_scale`` ``[N, 1]``), ``tensor`` (one value)
  or ``block`` (``block_structure``), symmetric, static.

Anything else (another method, int8, 4-bit, an fp8 variant other than e4m3, a missing block
size) is refused before loading. The weights are read by transformers into a bf16 model (e4m3
values are exact in bf16, with the ``quantization_config`` left out so transformers' own
quantizer stays out of the way); the scale tensors are read here from the safetensors files.
Activation scales of a checkpoint (static ``input_scale``) are not used: activations are
quantized per token, dynamically.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from actors.engine.model.quantization.fp8_math import quantize_weight_torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Fp8CheckpointFormat:
    """How an FP8 checkpoint stores its weights' scales."""

    method: str                       # "fp8" or "compressed-tensors"
    scale_suffix: str                 # "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] | None     # (bn, bk) of block-wise scales, else None
    ignored: tuple[str, ...] = ()     # modules the checkpoint keeps unquantized


def _refuse(rule: str) -> ValueError:
    return ValueError(f"engine.quantization: 'fp8' {rule}")


def _block(value: Any, field: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(f"needs {field} as two positive integers, the checkpoint has {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict) -> Fp8CheckpointFormat:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"loads compressed-tensors checkpoints of format float-quantized or "
                      f"naive-quantized; this one is {fmt!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("found no config_groups in the compressed-tensors config")
    kinds = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if (weights.get("num_bits") != 8 or weights.get("type") != "float"
                or weights.get("symmetric") is False or weights.get("dynamic")):
            raise _refuse(f"loads 8-bit float, symmetric, static weight quantization; "
                          f"config_groups.{name}.weights is {weights!r}")
        strategy = weights.get("strategy")
        if strategy == "block":
            kinds.add(("block", _block(weights.get("block_structure"),
                                       f"config_groups.{name}.weights.block_structure")))
        elif strategy in ("channel", "tensor"):
            kinds.add((strategy, None))
        else:
            raise _refuse(f"loads weight strategies channel, tensor or block; "
                          f"config_groups.{name} has {strategy!r}")
        if "Linear" not in (group.get("targets") or []):
            raise _refuse(f"expects config_groups.{name}.targets to name Linear, got "
                          f"{group.get('targets')!r}")
    blocks = {block for _, block in kinds if block is not None}
    if len(blocks) > 1:
        raise _refuse(f"expects one block structure, the checkpoint has {sorted(blocks)}")
    return Fp8CheckpointFormat("compressed-tensors", "weight_scale",
                               next(iter(blocks)) if blocks else None,
                               tuple(qc.get("ignore") or ()))


def checkpoint_format(hf_config: Any) -> Fp8CheckpointFormat | None:
    """The FP8 format of a checkpoint's config, None for an unquantized checkpoint.

    Raises:
        ValueError: a quantized checkpoint whose format is not one listed in the
            module docstring (naming what was found).
    """
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse(f"loads e4m3 weights; this checkpoint's fmt is {qc.get('fmt')!r}")
        return Fp8CheckpointFormat("fp8", "weight_scale_inv",
                                   _block(qc.get("weight_block_size"), "weight_block_size"),
                                   tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse(f"takes an unquantized checkpoint or an FP8 one (quant_method 'fp8' or "
                  f"'compressed-tensors'); this checkpoint is quantized with {method!r}")


def _safetensors_files(model: str, revision: str | None) -> list[str]:
    if os.path.isdir(model):
        files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    else:
        from huggingface_hub import snapshot_download

        root = snapshot_download(model, revision=revision, allow_patterns=["*.safetensors"])
        files = sorted(glob.glob(os.path.join(root, "*.safetensors")))
    if not files:
        raise _refuse(f"reads the scales of an FP8 checkpoint from safetensors files; "
                      f"{model!r} has none")
    return files


def read_weight_scales(model: str, revision: str | None, fmt: Fp8CheckpointFormat
                       ) -> dict[str, torch.Tensor]:
    """``{module name: scale tensor}`` of every quantized weight in the checkpoint."""
    from safetensors import safe_open

    suffix = "." + fmt.scale_suffix
    scales: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model, revision):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if key.endswith(suffix):
                    scales[key[:-len(suffix)]] = f.get_tensor(key)
    logger.info("FP8 checkpoint (%s): %d weight scales", fmt.method, len(scales))
    return scales


def per_channel(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                name: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A checkpoint weight as ``(q, per-channel scale [N], exact)``: per-tensor and
    per-channel scales are taken as they are (``exact``); block-wise ones are dequantized and
    quantized again per channel (``quantize_weight_torch``)."""
    n, k = values.shape
    scale = scale.to(values.device, torch.float32)
    if scale.numel() == 1:
        return values, scale.reshape(1).expand(n), True
    if scale.numel() == n and (scale.dim() == 1 or scale.shape == (n, 1)):
        return values, scale.reshape(n), True
    if block is not None:
        bn, bk = block
        if scale.shape == (-(-n // bn), -(-k // bk)):
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            q, channel = quantize_weight_torch(values.float() * full)
            return q, channel, False
    raise _refuse(f"cannot read the scale of {name} (shape {tuple(scale.shape)} for a weight "
                  f"of shape {(n, k)}, block {block})")
