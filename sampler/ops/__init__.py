"""One module per pipeline step (docs/sampler.md §2), torch implementations.

Every op takes the batch tensor plus ``idx_mapping`` (``[rows]`` int64, the slot of each row)
and reads per-slot state (``[max_num_seqs]`` or ``[max_num_seqs, ...]`` tensors) through it.
``apply_*`` functions mutate the logits in place and return None; ``compute_*`` functions
return new tensors. All of them work on float32 logits, contiguous or not.
"""

from sampler.ops.allowed import apply_allowed_token_ids
from sampler.ops.bad_words import apply_bad_words
from sampler.ops.gumbel import compute_gumbel_noise, compute_sampled_ids
from sampler.ops.logit_bias import apply_logit_bias
from sampler.ops.logprobs import compute_logprob_outputs, compute_topk
from sampler.ops.min_p import apply_min_p
from sampler.ops.min_tokens import apply_min_tokens
from sampler.ops.penalties import apply_penalties
from sampler.ops.temperature import apply_temperature
from sampler.ops.token_bitmask import apply_token_bitmask
from sampler.ops.top_k_top_p import apply_top_k_top_p

__all__ = [
    "apply_allowed_token_ids",
    "apply_bad_words",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_token_bitmask",
    "apply_top_k_top_p",
    "compute_gumbel_noise",
    "compute_logprob_outputs",
    "compute_sampled_ids",
    "compute_topk",
]
