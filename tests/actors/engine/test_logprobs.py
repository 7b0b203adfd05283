"""Logprobs of generated tokens (raw and temperature modes), ranks, top-k and prompt
logprobs against the HF model's own forward."""

from __future__ import annotations

import pytest
import torch

from sampler import SamplingParams
from tests.actors.helpers import hf_logits, make_engine, random_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=24)


def _reference(hf_reference, path, prompt, out):
    full = prompt + out.output_token_ids
    logits = hf_logits(hf_reference(path), full)
    start = len(prompt) - 1
    return logits[start:start + out.num_output_tokens]  # row t predicts output token t


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.3])
def test_raw_logprobs_match_hf_log_softmax(engine, tiny_llama, hf_reference, temperature):
    prompts = random_prompts([4, 17, 30, 9, 2], engine.loaded.vocab_size, seed=11)
    params = SamplingParams(temperature=temperature, max_tokens=20, seed=5, logprobs=3,
                            ignore_eos=True)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    for out in outs:
        logits = _reference(hf_reference, tiny_llama, prompts[out.id], out)
        logp = torch.log_softmax(logits, dim=-1)
        ids = torch.tensor(out.output_token_ids)
        expected = logp.gather(1, ids[:, None])[:, 0]
        assert len(out.logprobs) == out.num_output_tokens == 20
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
        ranks = 1 + (logp > expected[:, None]).sum(-1)
        assert out.sampled_ranks == ranks.tolist()
        if temperature == 0.0:
            assert set(out.sampled_ranks) == {1}
        for t, top in enumerate(out.top_logprobs):
            assert len(top) == 3
            ref_vals, ref_ids = logp[t].topk(3)
            assert [e["token_id"] for e in top] == ref_ids.tolist()
            torch.testing.assert_close(torch.tensor([e["logprob"] for e in top]), ref_vals,
                                       atol=1e-5, rtol=0)


def test_temperature_logprobs_match_scaled_log_softmax(engine, tiny_llama, hf_reference):
    prompts = random_prompts([6, 25, 13], engine.loaded.vocab_size, seed=12)
    temp = 0.7
    params = SamplingParams(temperature=temp, max_tokens=16, seed=9, logprobs=0,
                            logprobs_mode="temperature_logprobs", ignore_eos=True)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    for out in outs:
        logits = _reference(hf_reference, tiny_llama, prompts[out.id], out)
        expected = torch.log_softmax(logits / temp, dim=-1).gather(
            1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
        raw = torch.log_softmax(logits, dim=-1).gather(
            1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        assert (torch.tensor(out.logprobs) - raw).abs().max() > 1e-3  # the mode matters
        assert out.top_logprobs is None


def test_prompt_logprobs_match_hf(engine, tiny_llama, hf_reference):
    # the 40-token prompt is scored over several prefill chunks (token budget 24)
    prompts = random_prompts([40, 7, 1], engine.loaded.vocab_size, seed=13)
    params = SamplingParams(max_tokens=2, seed=1, prompt_logprobs=2)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    for out in outs:
        prompt = prompts[out.id]
        assert out.logprobs is None and out.sampled_ranks is None
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        if len(prompt) == 1:
            continue
        logp = torch.log_softmax(hf_logits(hf_reference(tiny_llama), prompt), dim=-1)
        expected = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), expected,
                                   atol=1e-5, rtol=0)
        for i in range(1, len(prompt)):
            assert [e["token_id"] for e in out.prompt_top_logprobs[i]] == \
                logp[i - 1].topk(2).indices.tolist()


def test_no_logprobs_unless_requested(engine):
    out = engine.generate([(0, [5, 6, 7], SamplingParams(max_tokens=3, seed=0))])[0]
    assert out.logprobs is None and out.top_logprobs is None and out.sampled_ranks is None
    assert out.prompt_logprobs is None and out.prompt_top_logprobs is None


def test_whole_vocab_logprobs(engine):
    out = engine.generate([(0, [5, 6, 7], SamplingParams(max_tokens=2, seed=0,
                                                         logprobs=-1))])[0]
    vocab = engine.loaded.vocab_size
    assert all(len(step) == vocab for step in out.top_logprobs)
    total = torch.tensor([e["logprob"] for e in out.top_logprobs[0]]).exp().sum()
    assert abs(total.item() - 1.0) < 1e-4
