"""Prompt logprobs: raw logprobs of the next prompt tokens, in bounded chunks."""

from __future__ import annotations

import pytest
import torch

from sampler import compute_prompt_logprobs
from sampler.ops.logprobs import compute_topk

from tests.sampler.helpers import random_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_ranks_and_topk(dtype):
    tokens, vocab = 37, 1000
    logits = random_logits(tokens, vocab, 1, ties=True).to(dtype)
    targets = torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(2))
    out = compute_prompt_logprobs(logits, targets, num_logprobs=5)
    want = torch.log_softmax(logits.float(), -1)
    assert torch.equal(out.token_ids, targets)
    assert torch.equal(out.logprobs, want.gather(1, targets[:, None])[:, 0])
    assert torch.equal(out.ranks, 1 + (want > out.logprobs[:, None]).sum(-1))
    ids, vals = compute_topk(want, 5)
    assert torch.equal(out.topk_ids, ids) and torch.equal(out.topk_values, vals)
    assert (out.logprobs <= 0).all()


def test_chunking_does_not_change_results():
    logits = random_logits(50, 333, 3)
    targets = list(range(50))
    whole = compute_prompt_logprobs(logits, targets, num_logprobs=3, chunk_size=1000)
    for chunk in (1, 7, 49, 50):
        part = compute_prompt_logprobs(logits, targets, num_logprobs=3, chunk_size=chunk)
        for name in ("logprobs", "ranks", "topk_ids", "topk_values"):
            assert torch.equal(getattr(part, name), getattr(whole, name)), (chunk, name)


def test_memory_is_bounded_by_the_chunk(monkeypatch):
    seen = []
    real = torch.log_softmax

    def spy(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    compute_prompt_logprobs(random_logits(100, 64, 4), list(range(64)) + [0] * 36, chunk_size=16)
    assert max(seen) == 16 and sum(seen) == 100


def test_modes_whole_vocab_and_no_topk():
    logits = random_logits(4, 20, 5)
    targets = [1, 2, 3, 4]
    raw = compute_prompt_logprobs(logits, targets, mode="raw_logits")
    assert torch.equal(raw.logprobs, logits[torch.arange(4), targets]) and raw.topk_ids is None
    temp = compute_prompt_logprobs(logits, targets, mode="temperature_logprobs", temperature=0.5)
    want = torch.log_softmax(logits / 0.5, -1)[torch.arange(4), targets]
    assert torch.equal(temp.logprobs, want)
    processed = compute_prompt_logprobs(logits, targets, mode="processed_logprobs")
    assert torch.equal(processed.logprobs, compute_prompt_logprobs(logits, targets).logprobs)
    full = compute_prompt_logprobs(logits, targets, num_logprobs=-1)
    assert full.topk_ids.shape == (4, 20)
    assert sorted(full.topk_ids[0].tolist()) == list(range(20))
    empty = compute_prompt_logprobs(logits[:0], [], num_logprobs=2)
    assert empty.logprobs.shape == (0,) and empty.topk_ids.shape == (0, 2)


def test_errors_name_the_argument():
    logits = random_logits(3, 10, 6)
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, [1, 2])
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, [1, 2, 10])
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(logits, [1, 2, 3], num_logprobs=-2)
    with pytest.raises(ValueError, match="mode"):
        compute_prompt_logprobs(logits, [1, 2, 3], mode="nope")
    with pytest.raises(ValueError, match="chunk_size"):
        compute_prompt_logprobs(logits, [1, 2, 3], chunk_size=0)
