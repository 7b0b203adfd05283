"""Backend choice, made once per Sampler or call: torch (reference, CPU and GPU), Triton (the
fused GPU kernel of :mod:`sampler.kernels`; on CPU only under ``TRITON_INTERPRET=1``) and
FlashInfer (:mod:`sampler.flashinfer_pipeline`: FlashInfer's sampling kernels for the draw of
the steps that allow it, the Triton or torch path for the others).

"auto" picks Triton on CUDA when it is importable, else torch; FlashInfer is used only when
asked for (it is statistically equal to the other backends, not draw-for-draw, and ignores
seeds). The optional backends are looked up without importing them at ``import sampler``
time; the choice is logged once.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Callable, Literal

import torch

Backend = Literal["auto", "torch", "triton", "flashinfer"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "flashinfer")
MIN_FLASHINFER_SMS = 17  # FlashInfer's sampling kernels are unsupported on <= 16 SMs

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def available_backends(device: torch.device) -> tuple[str, ...]:
    """The concrete backends that can run the whole pipeline on ``device`` (torch, triton;
    flashinfer is checked only when asked for, see :func:`flashinfer_problem`)."""
    names = ["torch"]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if (device.type == "cuda" or interpret) and _has_triton():
        names.append("triton")
    return tuple(names)


def fallback_backend(device: torch.device) -> str:
    """The backend that runs a step the FlashInfer backend cannot: Triton where available,
    else torch (the "auto" choice)."""
    return "triton" if "triton" in available_backends(device) else "torch"


def _flashinfer_device_problem(device: torch.device) -> str | None:
    """Why FlashInfer's sampling kernels cannot run on ``device`` (None when they can)."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms < MIN_FLASHINFER_SMS:
        return f"its sampling kernels need more than 16 SMs, {device} has {sms}"
    return None


def flashinfer_problem(device: torch.device) -> str | None:
    """Why the FlashInfer backend is unavailable on ``device`` (None when it is). Imports
    ``flashinfer.sampling`` (the first call only; later calls find it in ``sys.modules``)."""
    try:
        importlib.import_module("flashinfer.sampling")
    except Exception as exc:  # ImportError, or a broken install failing at import time
        return (f"flashinfer is not importable ({type(exc).__name__}: {exc}); install the "
                "gpu extra: pip install 'raygen[gpu]'")
    return _flashinfer_device_problem(device)


def _flashinfer_version() -> str:
    import sys

    return str(getattr(sys.modules.get("flashinfer"), "__version__", "unknown version"))


def resolve_backend(backend: str, device: torch.device) -> str:
    """Picks the backend that runs the pipeline.

    Args:
        backend: "auto", "torch", "triton" or "flashinfer".
        device: the device of the logits.

    Returns:
        The concrete backend name, "torch", "triton" or "flashinfer".

    Raises:
        ValueError: unknown backend, or one this build or device does not provide.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    available = available_backends(device)
    if backend == "auto":
        chosen = "triton" if device.type == "cuda" and "triton" in available else "torch"
    else:
        chosen = backend
    if chosen == "flashinfer":
        problem = flashinfer_problem(device)
        if problem is not None:
            raise ValueError(f"backend: 'flashinfer' is not available: {problem} "
                             f"(available: {', '.join(available)}, or 'auto')")
    elif chosen not in available:
        raise ValueError(
            f"backend: {backend!r} is not available on {device.type} (available: "
            f"{', '.join(available)}, or 'auto')"
        )
    key = (chosen, device.type)
    if key not in _logged:
        _logged.add(key)
        if chosen == "flashinfer":
            logger.info("sampler backend: flashinfer %s on %s (steps it cannot sample run on "
                        "%s)", _flashinfer_version(), device.type, fallback_backend(device))
        else:
            logger.info("sampler backend: %s on %s", chosen, device.type)
    return chosen


def pipeline_fn(backend: str, device: torch.device | None = None) -> Callable:
    """The pipeline function of a resolved backend (imports the kernels on first use).

    Args:
        backend: a name returned by :func:`resolve_backend`.
        device: the logits' device (needed for "flashinfer": it picks the fallback path).

    Returns:
        A callable with the signature of :func:`sampler.pipeline.run_pipeline`. For
        "flashinfer" it is a new :class:`~sampler.flashinfer_pipeline.FlashInferPipeline`
        (it owns the RNG seed/offset tensors of its draws).
    """
    if backend == "flashinfer":
        from sampler.flashinfer_pipeline import FlashInferPipeline

        if device is None:
            raise ValueError("device: the flashinfer backend needs the logits' device")
        fallback = fallback_backend(device)
        return FlashInferPipeline(device, pipeline_fn(fallback), fallback)
    if backend == "triton":
        from sampler.kernels.launcher import run_pipeline_triton

        return run_pipeline_triton
    from sampler.pipeline import run_pipeline

    return run_pipeline
