"""Backend choice, made once per Sampler or call: torch (reference, CPU and GPU) and Triton
(the fused GPU kernel of :mod:`sampler.kernels`; on CPU only under ``TRITON_INTERPRET=1``).

"auto" picks Triton on CUDA when it is importable, else torch. The optional backends are looked
up without importing them at ``import sampler`` time; the choice is logged once.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton", "flashinfer"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "flashinfer")

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def available_backends(device: torch.device) -> tuple[str, ...]:
    """The concrete backends that can run on ``device``."""
    names = ["torch"]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if (device.type == "cuda" or interpret) and _has_triton():
        names.append("triton")
    return tuple(names)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Picks the backend that runs the pipeline.

    Args:
        backend: "auto", "torch", "triton" or "flashinfer".
        device: the device of the logits.

    Returns:
        The concrete backend name, "torch" or "triton".

    Raises:
        ValueError: unknown backend, or one this build does not provide yet.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    available = available_backends(device)
    if backend == "auto":
        chosen = "triton" if device.type == "cuda" and "triton" in available else "torch"
    else:
        chosen = backend
    if chosen not in available:
        raise ValueError(
            f"backend: {backend!r} is not available on {device.type} (available: "
            f"{', '.join(available)}, or 'auto')"
        )
    key = (chosen, device.type)
    if key not in _logged:
        _logged.add(key)
        logger.info("sampler backend: %s on %s", chosen, device.type)
    return chosen


def pipeline_fn(backend: str):
    """The pipeline function of a resolved backend (imports the kernels on first use)."""
    if backend == "triton":
        from sampler.kernels.pipeline import run_pipeline_triton

        return run_pipeline_triton
    from sampler.pipeline import run_pipeline

    return run_pipeline
