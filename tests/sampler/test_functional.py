"""sample_logits: argument checks and unseeded rows."""

from __future__ import annotations

import pytest
import torch

from sampler import Sampler, SamplingParams, sample_logits

from tests.sampler.helpers import random_logits


def test_errors_name_the_argument():
    x = random_logits(2, 10, 1)
    p = [SamplingParams(seed=1)] * 2
    cases = [
        (dict(logits=x[0], params=p[:1]), "logits"),
        (dict(logits=x.long(), params=p), "logits"),
        (dict(logits=x, params=p[:1]), "params"),
        (dict(logits=x, params=[p[0], {"seed": 1}]), "params"),
        (dict(logits=x, params=p, prompt_token_ids=[[1]]), "prompt_token_ids"),
        (dict(logits=x, params=p, prompt_token_ids=[[1], [10]]), "prompt_token_ids"),
        (dict(logits=x, params=p, output_token_ids=[[1], [-3]]), "output_token_ids"),
        (dict(logits=x, params=p, sample_indices=[0, -1]), "sample_indices"),
        (dict(logits=x, params=p, eos_token_ids=[10]), "eos_token_ids"),
        (dict(logits=x, params=p, bad_words_token_ids=[[[1]], [[11]]]), "bad_words_token_ids"),
        (dict(logits=x, params=p, backend="tpu"), "backend"),
        (dict(logits=x, params=[SamplingParams(logprobs=5, seed=1)] * 2, max_logprobs=4),
         "logprobs"),
        (dict(logits=x, params=[SamplingParams(allowed_token_ids=[10])] * 2), "allowed_token_ids"),
        (dict(logits=x, params=p, noise_precision="fp16"), "noise_precision"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            sample_logits(**kwargs)


def test_unseeded_rows_draw_fresh_seeds():
    x = torch.zeros(64, 1000)
    a = sample_logits(x, [SamplingParams()] * 64).token_ids
    b = sample_logits(x, [SamplingParams()] * 64).token_ids
    assert not torch.equal(a, b)  # 64 uniform draws over 1000 ids repeating: ~1e-192
    seeded = [SamplingParams(seed=5)] * 64
    assert torch.equal(sample_logits(x, seeded).token_ids, sample_logits(x, seeded).token_ids)


def test_empty_batch():
    out = sample_logits(torch.zeros(0, 10), [])
    assert out.token_ids.shape == (0,)
    s = Sampler(2, 10, device="cpu", eos_token_ids=[0])
    s.add_request(1, SamplingParams(logprobs=3), [1], seed=1)
    out = s.sample(torch.zeros(0, 10), [])
    assert out.token_ids.shape == (0,) and out.logprobs is None
