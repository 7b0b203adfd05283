"""The batch an engine runs once before real work (``Engine.warm_up``), so the first real
batch does not pay for compiling or loading kernels, nor for growing host buffers and pools."""

from __future__ import annotations

from typing import Any


def warm_up_requests(vocab_size: int, num_requests: int, max_logprobs: int) -> list[tuple]:
    """``[(request_id, prompt_ids, params)]``: ``num_requests`` (at least six) short
    requests, 16 prompt and 8 output tokens, cycling six kinds of sampling: greedy, seeded
    top-p, top-k, min-p with top-k and top-p, top-k logprobs (up to ``max_logprobs``) and the
    sampled token's logprob."""
    from sampler import SamplingParams

    common: dict[str, Any] = dict(max_tokens=8, ignore_eos=True, detokenize=False)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=1),
             dict(temperature=1.0, top_k=50),
             dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2),
             dict(temperature=1.0, logprobs=min(20, max_logprobs)),
             dict(temperature=0.0, logprobs=0)]
    params = [SamplingParams(**kind, **common) for kind in kinds]
    return [(f"__warm_up__.{i}", [(97 * i + 13 * j + 5) % vocab_size for j in range(16)],
             params[i % len(params)])
            for i in range(max(len(params), num_requests))]
