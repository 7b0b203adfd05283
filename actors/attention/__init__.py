"""Attention backends over the paged KV cache (torch reference; FlashInfer on GPU later)."""

from __future__ import annotations

import logging
from typing import Any

from actors.attention.base import (
    ATTENTION_NAME,
    STEP_KWARG,
    AttentionBackend,
    StepContext,
    paged_attention_forward,
    register_attention,
)
from actors.attention.metadata import AttentionMetadata

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


def get_attention_backend(
    name: str, kv_cache: Any, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """Builds the backend ``name`` ("auto" | "torch" | "flashinfer") over ``kv_cache``."""
    if name == "flashinfer":
        raise NotImplementedError(
            "engine.attention_backend: 'flashinfer' is not available in this build; use "
            "'torch' or 'auto'"
        )
    if name not in ("auto", "torch"):
        raise ValueError(f"engine.attention_backend: unknown backend {name!r}")
    from actors.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend(kv_cache, num_heads, num_kv_heads, head_dim)
    logger.info("attention backend: %s", backend.name)
    return backend
