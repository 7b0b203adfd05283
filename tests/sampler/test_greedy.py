"""Greedy rows: argmax after steps 2–6, ties to the lowest id; mixed and all-greedy batches."""

from __future__ import annotations

import pytest
import torch

import sampler.ops.gumbel as gumbel
from sampler import SamplingParams, sample_logits

from tests.sampler.helpers import oracle_rows, random_logits, run_sampler


@pytest.mark.parametrize("rows,vocab", [(1, 111), (7, 32000), (99, 111), (7, 151936)])
def test_argmax_with_ties_goes_to_lowest_id(rows, vocab):
    logits = random_logits(rows, vocab, rows + vocab, ties=True)
    g = torch.Generator().manual_seed(0)
    for r in range(rows):  # plant a tie at the top: two or three equal maxima
        ids = torch.randperm(vocab, generator=g)[: 2 + r % 2]
        logits[r, ids] = logits[r].max() + 1.0
    params = [SamplingParams(temperature=0.0, seed=r) for r in range(rows)]
    out, _ = run_sampler(logits, params)
    top = logits.max(-1, keepdim=True).values
    lowest = torch.stack([torch.nonzero(logits[r] == top[r])[0, 0] for r in range(rows)])
    assert torch.equal(out.token_ids, lowest)
    assert out.token_ids.tolist() == [res.token_id for res in oracle_rows(logits, params)]


def test_greedy_uses_logits_after_masks_and_penalties_only():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    p = SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3, 4], logit_bias={3: 1.5},
                       top_k=1, top_p=0.01, min_p=0.9, seed=0)  # filters ignored when greedy
    out, processed = run_sampler(logits, [p], prompts=[[1]], eos=[2])
    # 0 not allowed; 1 keeps 4.0 (no repetition penalty); 3 -> 3.5
    assert out.token_ids.tolist() == [1]
    assert torch.isfinite(processed).sum() == 4  # no top-k/top-p/min-p on a greedy row
    p2 = p.replace(repetition_penalty=2.0, logit_bias={3: 0.5})
    out, _ = run_sampler(logits, [p2], prompts=[[1]], eos=[2])
    # 1: 4 / 2 = 2.0; 2: 3.0; 3: 2 + 0.5 = 2.5; 4: 1.0
    assert out.token_ids.tolist() == [2]
    out, _ = run_sampler(logits, [p2.replace(min_tokens=1)], prompts=[[1]], eos=[2])
    assert out.token_ids.tolist() == [3]  # EOS 2 masked before min_tokens


def test_mixed_greedy_and_random_batch():
    vocab = 1000
    logits = random_logits(40, vocab, 9, ties=True)
    params = [
        SamplingParams(temperature=0.0 if r % 3 == 0 else 0.7 + r / 40, top_k=r % 7,
                       top_p=0.9 if r % 2 else 1.0, seed=1000 + r)
        for r in range(40)
    ]
    out, processed = run_sampler(logits, params)
    assert out.token_ids.tolist() == [res.token_id for res in oracle_rows(logits, params)]
    greedy = [r for r in range(40) if r % 3 == 0]
    assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(-1))
    assert torch.equal(processed[greedy], logits[greedy])  # steps 8-11 leave greedy rows alone
    # each random row alone draws the same token as in the mixed batch
    for r in (1, 2, 5):
        alone, _ = run_sampler(logits[r:r + 1], params[r:r + 1])
        assert alone.token_ids[0] == out.token_ids[r]


def test_all_greedy_batch_computes_no_noise(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("noise computed for an all-greedy batch")

    monkeypatch.setattr(gumbel, "compute_gumbel_noise", fail)
    logits = random_logits(7, 111, 1)
    out = sample_logits(logits, [SamplingParams(temperature=0.0)] * 7)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    with pytest.raises(AssertionError, match="noise computed"):
        sample_logits(logits, [SamplingParams(temperature=0.0)] * 6 + [SamplingParams(seed=1)])


def test_all_random_batch_skips_the_greedy_argmax(monkeypatch):
    calls = []
    real = gumbel.compute_sampled_ids

    def spy(*args, **kwargs):
        calls.append((kwargs["any_greedy"], kwargs["any_random"]))
        return real(*args, **kwargs)

    monkeypatch.setattr("sampler.pipeline.compute_sampled_ids", spy)
    logits = random_logits(5, 111, 2)
    sample_logits(logits, [SamplingParams(seed=r) for r in range(5)])
    sample_logits(logits, [SamplingParams(temperature=0.0)] * 5)
    sample_logits(logits[:2], [SamplingParams(temperature=0.0), SamplingParams(seed=1)])
    assert calls == [(False, True), (True, False), (True, True)]
