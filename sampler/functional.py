"""``sample_logits``: the stateless entry point (docs/sampler.md §0), on the Sampler's own ops.

It builds a throw-away per-row state (one slot per row) from the lists it is given and runs
the same pipeline as :class:`~sampler.sampler.Sampler`, so both give the same results on the
same inputs.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import numpy as np
import torch

from sampler.backends import pipeline_fn, resolve_backend
from sampler.ops.gumbel import NoisePrecision
from sampler.sampler_output import SamplerOutput
from sampler.params import SamplingParams
from sampler.step_plan import make_plan
from sampler.state import SamplerState
from sampler.validation import as_bad_words, as_seed, as_token_array, check_logits


def _per_row(name: str, value: Sequence | None, rows: int) -> Sequence:
    if value is None:
        return [None] * rows
    if len(value) != rows:
        raise ValueError(f"{name}: expected one entry per row ({rows}), got {len(value)}")
    return value


def sample_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    sample_indices: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    backend: str = "auto",
    *,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None = None,
    max_logprobs: int | None = None,
    noise_precision: NoisePrecision = "fp32",
) -> SamplerOutput:
    """Samples one token per row with the full pipeline (stateless).

    Args:
        logits: ``[rows, vocab]`` float32/bf16/fp16, CPU or CUDA, any strides; not modified.
        params: one SamplingParams per row. A row whose ``seed`` is None gets a fresh random
            seed (the engine derives seeds instead; pass a seed for reproducible draws).
        prompt_token_ids: per row, the prompt ids (repetition penalty's prompt set).
        output_token_ids: per row, the ids generated so far: penalties, bad words, min_tokens,
            and the output position ``len(output_token_ids[i])``. -1 marks an id not known yet.
        sample_indices: per row, which of the n samples it draws (default 0).
        eos_token_ids: the model's EOS ids (masked until min_tokens).
        backend: "auto" | "torch" | "triton" | "flashinfer".
        bad_words_token_ids: per row, the tokenized bad words (lists of ids); the strings in
            ``params.bad_words`` need a tokenizer and are not read here.
        max_logprobs: the largest logprobs request allowed (default: the vocab size).
        noise_precision: "fp32" or "fp64" Gumbel noise.

    Returns:
        :class:`~sampler.sampler_output.SamplerOutput` with ``token_ids [rows]`` and, when a
        row asked for logprobs, ``logprobs``, ``ranks`` and (K > 0) ``topk_ids`` /
        ``topk_values``.

    Raises:
        ValueError: naming the argument, for a malformed input.

    Example:
        >>> out = sample_logits(torch.tensor([[0.0, 2.0, 1.0]]), [SamplingParams(temperature=0)])
        >>> out.token_ids
        tensor([1])
    """
    logits = check_logits(logits)
    rows, vocab = logits.shape
    params = list(params)
    if len(params) != rows:
        raise ValueError(f"params: expected one SamplingParams per row ({rows}), got {len(params)}")
    prompts = _per_row("prompt_token_ids", prompt_token_ids, rows)
    outputs = _per_row("output_token_ids", output_token_ids, rows)
    indices = _per_row("sample_indices", sample_indices, rows)
    words = _per_row("bad_words_token_ids", bad_words_token_ids, rows)
    eos = as_token_array("eos_token_ids", list(eos_token_ids or ()), vocab).tolist()
    if max_logprobs is None:
        max_logprobs = vocab
    if noise_precision not in ("fp32", "fp64"):
        raise ValueError(f"noise_precision: must be 'fp32' or 'fp64', got {noise_precision!r}")
    run = pipeline_fn(resolve_backend(backend, logits.device), logits.device)

    state = SamplerState(max(rows, 1), vocab, logits.device, list(dict.fromkeys(eos)))
    for row, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params: row {row} is not a SamplingParams ({type(p).__name__})")
        p.verify_for_model(vocab, max_logprobs=max_logprobs)
        seed = as_seed(p.seed) if p.seed is not None else secrets.randbits(63)
        index = 0 if indices[row] is None else indices[row]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"sample_indices: row {row} must be an int >= 0, got {index!r}")
        state.add_request(
            row, p,
            as_token_array("prompt_token_ids", prompts[row], vocab),
            as_token_array("output_token_ids", outputs[row], vocab, allow_placeholder=True),
            seed, int(index), as_bad_words(words[row], vocab),
        )
    state.flush()
    rows_host = np.arange(rows, dtype=np.int64)
    idx = torch.arange(rows, dtype=torch.int64, device=logits.device)
    return run(logits, idx, state, make_plan(state, rows_host), inplace=False,
                        precision=noise_precision)
