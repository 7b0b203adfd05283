"""Logits -> token ids + logprobs: SamplingParams, the stateful Sampler and its ops."""

from sampler.params import LOGPROBS_MODES, LogprobsMode, SamplingParams

__all__ = ["LOGPROBS_MODES", "LogprobsMode", "SamplingParams"]
