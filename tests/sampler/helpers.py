"""Shared helpers for the sampler tests."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from sampler import Sampler, SamplerOutput, SamplingParams
from tests.sampler.reference import reference_row


def random_logits(
    rows: int, vocab: int, seed: int, *, scale: float = 3.0, ties: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Normal logits; with ``ties`` the values are quantised so many tokens share a value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    if ties:
        x = torch.round(x * 2) / 2
    return x.to(dtype)


def run_sampler(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    sample_indices: Sequence[int] | None = None,
    eos: Sequence[int] = (),
    bad_words: Sequence[Sequence[Sequence[int]]] | None = None,
    slots: Sequence[int] | None = None,
    max_num_seqs: int | None = None,
    noise_precision: str = "fp32",
) -> tuple[SamplerOutput, torch.Tensor]:
    """One step of a fresh Sampler; returns (output, processed logits [rows, vocab])."""
    rows, vocab = logits.shape
    slots = list(slots) if slots is not None else list(range(rows))
    sampler = Sampler(max_num_seqs or max(slots, default=0) + 1, vocab, device="cpu",
                      eos_token_ids=list(eos), max_logprobs=vocab,
                      noise_precision=noise_precision)
    for r, p in enumerate(params):
        sampler.add_request(
            slots[r], p, prompts[r] if prompts else [], seed=p.seed,
            sample_index=sample_indices[r] if sample_indices else 0,
            output_token_ids=outputs[r] if outputs else (),
            bad_words_token_ids=bad_words[r] if bad_words else (),
        )
    work = logits.float().clone() if logits.dtype == torch.float32 else logits.clone()
    out = sampler.sample(work, slots)
    processed = work if logits.dtype == torch.float32 else None
    return out, processed


def oracle_rows(logits, params, *, prompts=None, outputs=None, sample_indices=None, eos=(),
                bad_words=None, noise_precision="fp32"):
    """The reference result of every row."""
    return [
        reference_row(
            logits[r], p, seed=p.seed,
            prompt_token_ids=prompts[r] if prompts else (),
            output_token_ids=outputs[r] if outputs else (),
            sample_index=sample_indices[r] if sample_indices else 0,
            eos_token_ids=eos,
            bad_words_token_ids=bad_words[r] if bad_words else (),
            noise_precision=noise_precision,
        )
        for r, p in enumerate(params)
    ]


def assert_same_output(a: SamplerOutput, b: SamplerOutput) -> None:
    """Exact equality of two outputs (NaN equal to NaN)."""
    for name in ("token_ids", "logprobs", "ranks", "topk_ids", "topk_values"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            x, y = x.cpu(), y.cpu()
            assert x.shape == y.shape, (name, x.shape, y.shape)
            assert torch.equal(x.isnan(), y.isnan()) if x.is_floating_point() else True, name
            if x.is_floating_point():
                x, y = x.nan_to_num(nan=0.0), y.nan_to_num(nan=0.0)
            assert torch.equal(x, y), (name, x, y)


def assert_matches_oracle(out: SamplerOutput, rows, params) -> None:
    """Tokens, logprobs, ranks and top-k of a batch equal the per-row oracle exactly."""
    assert out.token_ids.tolist() == [r.token_id for r in rows]
    if not any(p.logprobs is not None for p in params):
        assert out.logprobs is None
        return
    for i, (res, p) in enumerate(zip(rows, params)):
        if p.logprobs is None:
            assert math.isnan(out.logprobs[i].item())
            continue
        assert out.logprobs[i].item() == res.logprob, (i, out.logprobs[i].item(), res.logprob)
        assert out.ranks[i].item() == res.rank
        k = len(res.topk_ids)
        if k:
            assert out.topk_ids[i, :k].tolist() == res.topk_ids
            assert out.topk_values[i, :k].tolist() == res.topk_values
            assert (out.topk_ids[i, k:] == -1).all()
            assert torch.isneginf(out.topk_values[i, k:]).all()


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit, bins with a small expectation pooled together."""
    from scipy import stats

    order = np.argsort(expected)
    obs, exp = observed[order].astype(np.float64), expected[order].astype(np.float64)
    small = np.cumsum(exp) < min_expected * 2
    pooled_obs = np.concatenate([[obs[small].sum()], obs[~small]]) if small.any() else obs
    pooled_exp = np.concatenate([[exp[small].sum()], exp[~small]]) if small.any() else exp
    return float(stats.chisquare(pooled_obs, pooled_exp * pooled_obs.sum() / pooled_exp.sum())
                 .pvalue)
