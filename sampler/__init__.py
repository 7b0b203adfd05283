"""Logits -> token ids + logprobs: SamplingParams, the stateful Sampler and its ops.

``import sampler`` loads torch and numpy only (no ray, transformers, triton or flashinfer).
"""

from sampler.functional import sample_logits
from sampler.output import AsyncOutput, HostOutput, SamplerOutput
from sampler.params import LOGPROBS_MODES, LogprobsMode, SamplingParams
from sampler.prompt_logprobs import compute_prompt_logprobs
from sampler.sampler import Sampler
from sampler.seeding import derive_seed

__all__ = [
    "LOGPROBS_MODES",
    "AsyncOutput",
    "HostOutput",
    "LogprobsMode",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "compute_prompt_logprobs",
    "derive_seed",
    "sample_logits",
]
