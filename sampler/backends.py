"""Backend choice, made once per Sampler: torch now; Triton and FlashInfer plug in here.

The optional backends are looked up without importing them at ``import sampler`` time.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton", "flashinfer"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "flashinfer")
AVAILABLE: tuple[str, ...] = ("torch",)

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def resolve_backend(backend: str, device: torch.device) -> str:
    """Picks the backend that runs the pipeline.

    Args:
        backend: "auto", "torch", "triton" or "flashinfer".
        device: the device of the logits.

    Returns:
        The concrete backend name ("torch" for now).

    Raises:
        ValueError: unknown backend, or one this build does not provide yet.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    chosen = "torch" if backend == "auto" else backend
    if chosen not in AVAILABLE:
        raise ValueError(
            f"backend: {backend!r} is not available in this build (available: "
            f"{', '.join(AVAILABLE)}, or 'auto')"
        )
    key = (chosen, device.type)
    if key not in _logged:
        _logged.add(key)
        logger.info("sampler backend: %s on %s", chosen, device.type)
    return chosen
