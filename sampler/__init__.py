"""Logits -> token ids + logprobs: SamplingParams, the stateful Sampler and its ops.

``import sampler`` loads nothing heavy; its names are imported on first use, so
``from sampler.params import SamplingParams`` (what a job driver validates rows with) loads no
torch, and ``from sampler import Sampler`` loads torch and numpy only (no ray, transformers,
triton or flashinfer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the submodule that defines it
_EXPORTS = {
    "LOGPROBS_MODES": "sampler.params",
    "AsyncOutput": "sampler.sampler_output",
    "HostOutput": "sampler.sampler_output",
    "LogprobsMode": "sampler.params",
    "Sampler": "sampler.sampler",
    "SamplerOutput": "sampler.sampler_output",
    "SamplingParams": "sampler.params",
    "StructuredOutputsParams": "sampler.structured_params",
    "compute_prompt_logprobs": "sampler.prompt_logprobs",
    "derive_seed": "sampler.seeding",
    "sample_logits": "sampler.functional",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from sampler.functional import sample_logits
    from sampler.sampler_output import AsyncOutput, HostOutput, SamplerOutput
    from sampler.params import LOGPROBS_MODES, LogprobsMode, SamplingParams
    from sampler.prompt_logprobs import compute_prompt_logprobs
    from sampler.sampler import Sampler
    from sampler.seeding import derive_seed
    from sampler.structured_params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sampler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
