"""The slow, obviously-correct oracle: docs/sampler.md §2–3 one row at a time.

Plain Python loops over token sets and numpy float32 element arithmetic (IEEE single, the same
rounding as the float32 kernels); transcendental functions (exp, log_softmax, cumsum) and the
counter-based noise come from torch / :mod:`sampler.ops.gumbel` so a fast path can be compared
with it bit for bit. Only the tests use it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sampler.ops.gumbel import NoisePrecision, compute_gumbel_noise
from sampler.params import SamplingParams
from sampler.sampler_output import SamplerOutput

NEG_INF = np.float32(-np.inf)


@dataclass
class RowResult:
    """What the oracle computes for one row.

    Attributes:
        token_id: the sampled id.
        processed: ``[vocab]`` float32 logits after steps 2–11 (greedy rows: after 2–6).
        kept: ``[vocab]`` bool, the tokens that survive (finite processed logits).
        values: ``[vocab]`` float32 values of the row's logprobs mode.
        logprob, rank: the sampled token's value and rank (None without logprobs).
        topk_ids, topk_values: the requested top entries (empty without them).
    """

    token_id: int
    processed: np.ndarray
    kept: np.ndarray
    values: np.ndarray
    logprob: float | None
    rank: int | None
    topk_ids: list[int]
    topk_values: list[float]


def _log_softmax(row: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(row), dim=-1).numpy()


def reference_top_p_keep(x: np.ndarray, p: float) -> np.ndarray:
    """Tokens kept by top-p: the mass strictly more probable than t is < p (float32 sums)."""
    s = np.sort(x)[::-1].copy()  # descending
    if not np.isfinite(s[0]):
        return np.ones_like(x, dtype=bool)
    cum = torch.cumsum(torch.exp(torch.from_numpy(s - s[0])), dim=0).numpy()
    limit = np.float32(p) * cum[-1]
    kept_values = []
    group_start = 0
    for j in range(len(s)):
        if j > 0 and s[j] != s[j - 1]:
            group_start = j  # first index of this value's tie group
        mass_above = cum[group_start - 1] if group_start > 0 else np.float32(0.0)
        if mass_above < limit:
            kept_values.append(s[j])
    return np.isin(x, np.array(kept_values, dtype=np.float32))


def reference_row(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int,
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
    sample_index: int = 0,
    eos_token_ids: Sequence[int] = (),
    bad_words_token_ids: Sequence[Sequence[int]] = (),
    noise_precision: NoisePrecision = "fp32",
) -> RowResult:
    """Runs the whole pipeline on one row, the slow way.

    Args:
        logits: ``[vocab]`` float32/bf16/fp16 raw logits of the row.
        params: the row's SamplingParams.
        seed: the resolved seed.
        prompt_token_ids, output_token_ids: the row's prompt and generated ids (-1 = unknown).
        sample_index: which of the n samples.
        eos_token_ids: the model's EOS ids.
        bad_words_token_ids: tokenized bad words.
        noise_precision: "fp32" or "fp64".

    Returns:
        A :class:`RowResult`.
    """
    raw = logits.detach().float().cpu().numpy().copy()
    x = raw.copy()
    vocab = len(x)
    out = list(output_token_ids)
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        for t in range(vocab):
            if t not in allowed:
                x[t] = NEG_INF
    for word in bad_words_token_ids:
        prefix = list(word[:-1])
        if len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix:
            x[word[-1]] = NEG_INF
    if len(out) < params.min_tokens:
        for t in set(params.stop_token_ids) | set(eos_token_ids):
            x[t] = NEG_INF
    for t, b in (params.logit_bias or {}).items():
        x[t] = x[t] + np.float32(b)
    counts = Counter(t for t in out if t >= 0)
    r = np.float32(params.repetition_penalty)
    for t in set(prompt_token_ids) | set(counts):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in counts.items():
        x[t] = x[t] - np.float32(params.frequency_penalty) * np.float32(c)
        x[t] = x[t] - np.float32(params.presence_penalty)

    greedy = params.temperature == 0.0
    if greedy:
        token = int(np.argmax(x))  # first maximum = lowest id among ties
    else:
        x = x / np.float32(params.temperature)
        if params.min_p > 0:
            threshold = np.float32(x.max()) + np.float32(math.log(params.min_p))
            x[x < threshold] = NEG_INF
        if 0 < params.top_k < vocab:
            kth = sorted(x.tolist(), reverse=True)[params.top_k - 1]
            x[x < np.float32(kth)] = NEG_INF
        if params.top_p < 1:
            x[~reference_top_p_keep(x, params.top_p)] = NEG_INF
        noise = compute_gumbel_noise(torch.tensor([seed]), torch.tensor([len(out)]),
                                     torch.tensor([sample_index]), vocab, noise_precision)[0]
        dtype = np.float32 if noise_precision == "fp32" else np.float64
        token = int(np.argmax(x.astype(dtype) + noise.numpy()))

    mode = params.logprobs_mode
    if mode == "raw_logprobs":
        values = _log_softmax(raw)
    elif mode == "raw_logits":
        values = raw
    elif mode == "temperature_logprobs":
        values = _log_softmax(raw / np.float32(1.0 if greedy else params.temperature))
    elif mode == "processed_logprobs":
        values = _log_softmax(x)
    else:
        values = x.copy()
    logprob = rank = None
    topk_ids: list[int] = []
    topk_values: list[float] = []
    if params.logprobs is not None:
        logprob = float(values[token])
        rank = 1 + int(sum(1 for v in values if v > values[token]))
        k = vocab if params.logprobs == -1 else params.logprobs
        order = np.lexsort((np.arange(vocab), -values.astype(np.float64)))[:k]
        topk_ids = [int(t) for t in order]
        topk_values = [float(values[t]) for t in order]
    return RowResult(token, x, np.isfinite(x), values, logprob, rank, topk_ids, topk_values)


def reference_sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    sample_indices: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    *,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None = None,
    noise_precision: NoisePrecision = "fp32",
) -> SamplerOutput:
    """The oracle over a batch, with the output layout of ``sample_logits`` (CPU tensors).

    Every row must carry a seed in its params. Arguments as in
    :func:`sampler.functional.sample_logits`.
    """
    rows = logits.shape[0]
    results = []
    for r in range(rows):
        if params[r].seed is None:
            raise ValueError(f"params: row {r} needs a seed for the reference")
        results.append(reference_row(
            logits[r], params[r], seed=params[r].seed,
            prompt_token_ids=prompt_token_ids[r] if prompt_token_ids else (),
            output_token_ids=output_token_ids[r] if output_token_ids else (),
            sample_index=sample_indices[r] if sample_indices else 0,
            eos_token_ids=eos_token_ids or (),
            bad_words_token_ids=bad_words_token_ids[r] if bad_words_token_ids else (),
            noise_precision=noise_precision,
        ))
    token_ids = torch.tensor([res.token_id for res in results], dtype=torch.int64)
    asked = [p.logprobs is not None for p in params]
    if not any(asked):
        return SamplerOutput(token_ids)
    logprobs = torch.tensor([res.logprob if a else math.nan for res, a in zip(results, asked)],
                            dtype=torch.float32)
    ranks = torch.tensor([res.rank if a else 0 for res, a in zip(results, asked)])
    width = max(len(res.topk_ids) for res in results)
    if width == 0:
        return SamplerOutput(token_ids, logprobs, ranks)
    ids = torch.full((rows, width), -1, dtype=torch.int64)
    vals = torch.full((rows, width), -math.inf, dtype=torch.float32)
    for r, res in enumerate(results):
        ids[r, : len(res.topk_ids)] = torch.tensor(res.topk_ids, dtype=torch.int64)
        vals[r, : len(res.topk_values)] = torch.tensor(res.topk_values, dtype=torch.float32)
    return SamplerOutput(token_ids, logprobs, ranks, ids, vals)
