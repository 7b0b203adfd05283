"""Attention backends over the paged KV cache: FlashInfer on GPU, a torch reference anywhere."""

from __future__ import annotations

import logging
from typing import Any

import torch

from actors.engine.model.attention.base import (
    ATTENTION_NAME,
    STEP_KWARG,
    AttentionBackend,
    StepContext,
    paged_attention_forward,
    register_attention,
)
from actors.engine.model.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_NAME",
    "STEP_KWARG",
    "AttentionBackend",
    "AttentionMetadata",
    "StepContext",
    "get_attention_backend",
    "paged_attention_forward",
    "register_attention",
]


_SUPPORTED_HEAD_DIMS = (64, 128, 256)
#: (key width, value width) FlashInfer's kernels are used for: equal widths, and MLA's 192/128
_SUPPORTED_DIMS = {(d, d) for d in _SUPPORTED_HEAD_DIMS} | {(192, 128)}
_logged: set[tuple[str, str]] = set()


def flashinfer_available() -> bool:
    """Whether the ``flashinfer`` package can be imported (looked up once)."""
    global _FLASHINFER
    if _FLASHINFER is None:
        try:
            import flashinfer  # noqa: F401
            _FLASHINFER = True
        except Exception as exc:  # noqa: BLE001 - missing or broken install: use the fallback
            logger.debug("flashinfer not importable: %s", exc)
            _FLASHINFER = False
    return _FLASHINFER


_FLASHINFER: bool | None = None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype,
                         head_dim: int, *, value_dim: int | None = None,
                         layer_specs: dict | None = None) -> str:
    """The concrete backend for ``name``: "auto" picks FlashInfer on CUDA for bf16/fp16,
    supported key/value widths (``head_dim`` / ``value_dim``) and layers FlashInfer has a
    variant for (not soft-capping together with sinks, from ``layer_specs``) when it is
    installed, else the torch reference (logged once)."""
    both = any(getattr(s, "softcap", None) and getattr(s, "has_sinks", False)
               for s in (layer_specs or {}).values())
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"engine.attention_backend: unknown backend {name!r}")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("engine.attention_backend: 'flashinfer' needs a CUDA device")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"engine.attention_backend: 'flashinfer' needs bfloat16 or float16, "
                             f"got {dtype}")
        if not flashinfer_available():
            raise ValueError("engine.attention_backend: 'flashinfer' is not installed "
                             "(pip install raygen[gpu]); use 'auto' or 'torch'")
        if both:
            raise ValueError("engine.attention_backend: 'flashinfer' has no kernel for "
                             "soft-capping together with attention sinks; use 'torch'")
        return name
    if name == "torch":
        return name
    reason = None
    if device.type != "cuda":
        reason = "not on CUDA"
    elif dtype not in (torch.bfloat16, torch.float16):
        reason = f"dtype {dtype}"
    elif (head_dim, value_dim or head_dim) not in _SUPPORTED_DIMS:
        reason = f"key/value widths {head_dim}/{value_dim or head_dim}"
    elif both:
        reason = "soft-capping together with attention sinks"
    elif not flashinfer_available():
        reason = "flashinfer is not installed"
    chosen = "torch" if reason else "flashinfer"
    key = (chosen, reason or "")
    if key not in _logged:
        _logged.add(key)
        if reason and device.type == "cuda":
            logger.warning("attention backend: torch fallback (%s)", reason)
        else:
            logger.info("attention backend: %s%s", chosen, f" ({reason})" if reason else "")
    return chosen


def get_attention_backend(
    name: str, kv_cache: Any, *, num_heads: int, num_kv_heads: int, head_dim: int,
    layer_specs: dict | None = None,
    max_model_len: int | None = None,
) -> AttentionBackend:
    """Builds the backend ``name`` ("auto" | "torch" | "flashinfer") over ``kv_cache``.

    ``layer_specs`` (``{layer: LayerSpec}``, from the load-time probe) and
    ``max_model_len`` are needed by FlashInfer, which plans windows and scales per step.
    """
    chosen = resolve_backend_name(name, kv_cache.pool.device,
                                  getattr(kv_cache, "compute_dtype", kv_cache.pool.dtype),
                                  getattr(kv_cache, "key_dim", head_dim),
                                  value_dim=getattr(kv_cache, "value_dim", head_dim),
                                  layer_specs=layer_specs)
    if chosen == "flashinfer":
        from actors.engine.model.attention.flashinfer_backend import FlashInferBackend

        if layer_specs is None or max_model_len is None:
            raise ValueError("flashinfer backend: layer_specs and max_model_len are required")
        return FlashInferBackend(kv_cache, num_heads, num_kv_heads, head_dim,
                                 layer_specs=layer_specs, max_model_len=max_model_len)
    from actors.engine.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_cache, num_heads, num_kv_heads, head_dim)
