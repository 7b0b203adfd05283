"""bf16/fp16 input with float32 math, the pristine raw snapshot, non-contiguous logits."""

from __future__ import annotations

import random

import pytest
import torch

from sampler import LOGPROBS_MODES, Sampler, SamplingParams, sample_logits

from tests.sampler.helpers import assert_same_output, oracle_rows, random_logits


def _params(rows, vocab, seed):
    rng = random.Random(seed)
    return [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5, vocab // 3]),
            top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.4]), logit_bias={1: 0.5},
            logprobs=rng.choice([None, 0, 4]), logprobs_mode=LOGPROBS_MODES[r % 5],
            seed=rng.randrange(2**63),
        )
        for r in range(rows)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(7, 111), (7, 32000), (1, 151936)])
def test_half_input_equals_float32_of_the_same_values(dtype, rows, vocab):
    half = random_logits(rows, vocab, rows + vocab, ties=True).to(dtype)
    params = _params(rows, vocab, vocab)
    prompts = [[3, 4, 5]] * rows
    before = half.clone()
    out_half = sample_logits(half, params, prompt_token_ids=prompts)
    out_fp32 = sample_logits(half.float(), params, prompt_token_ids=prompts)
    assert_same_output(out_half, out_fp32)
    assert torch.equal(half.view(torch.int16), before.view(torch.int16))  # input untouched
    s = Sampler(rows, vocab, device="cpu", eos_token_ids=[0], max_logprobs=20)
    for r, p in enumerate(params):
        s.add_request(r, p, prompts[r], seed=p.seed)
    assert_same_output(s.sample(half, list(range(rows))), out_fp32)
    assert torch.equal(half.view(torch.int16), before.view(torch.int16))
    oracle = oracle_rows(half, params, prompts=prompts)
    assert out_half.token_ids.tolist() == [res.token_id for res in oracle]


def test_raw_snapshot_survives_in_place_steps():
    vocab = 200
    logits = random_logits(3, vocab, 8)
    pristine = logits.clone()
    mutating = dict(temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=2.0,
                    allowed_token_ids=list(range(0, vocab, 2)), logprobs=-1, seed=1)
    params = [SamplingParams(**mutating, logprobs_mode=m)
              for m in ("raw_logits", "raw_logprobs", "temperature_logprobs")]
    s = Sampler(3, vocab, device="cpu", eos_token_ids=[0], max_logprobs=vocab)
    for r, p in enumerate(params):
        s.add_request(r, p, [2, 4], seed=1)
    out = s.sample(logits, [0, 1, 2])  # float32: logits is the working buffer
    assert torch.isinf(logits).any(), "the float32 input was not used in place"
    wants = [pristine, torch.log_softmax(pristine, -1), torch.log_softmax(pristine / 0.5, -1)]
    for r, want in enumerate(wants):
        got = torch.empty(vocab)
        got[out.topk_ids[r]] = out.topk_values[r]
        assert torch.equal(got, want[r])


def test_stateless_call_never_modifies_float32_input():
    logits = random_logits(2, 100, 2)
    before = logits.clone()
    sample_logits(logits, [SamplingParams(top_k=2, seed=1, logprobs=1,
                                          logprobs_mode="processed_logits")] * 2)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_sliced_logits(dtype):
    rows, vocab, padded = 7, 1000, 1024
    full = random_logits(rows, padded, 4).to(dtype)
    full[:, vocab:] = 1e4  # padding columns would win if they were read
    sliced = full[:, :vocab]
    assert not sliced.is_contiguous()
    params = _params(rows, vocab, 4)
    contiguous = sliced.contiguous()
    want = sample_logits(contiguous, params)
    assert_same_output(sample_logits(sliced, params), want)
    s = Sampler(8, vocab, device="cpu", eos_token_ids=[0], max_logprobs=20)
    for r, p in enumerate(params):
        s.add_request(7 - r, p, [], seed=p.seed)
    assert_same_output(s.sample(sliced, [7 - r for r in range(rows)]), want)
    assert (full[:, vocab:] == 1e4).all()  # in-place steps stayed inside the slice


def test_all_greedy_half_batch_needs_no_float32_copy(monkeypatch):
    half = random_logits(5, 300, 9, ties=True).to(torch.bfloat16)
    want = half.float().argmax(-1)

    def no_copy(self, *args, **kwargs):
        raise AssertionError("float32 copy made")

    monkeypatch.setattr(torch.Tensor, "float", no_copy)
    out = sample_logits(half, [SamplingParams(temperature=0.0, logprobs=2)] * 5)
    monkeypatch.undo()
    assert torch.equal(out.token_ids, want)
    assert torch.equal(out.logprobs, torch.log_softmax(half.float(), -1).gather(1, want[:, None])[:, 0])


@pytest.mark.parametrize("rows,vocab", [(7, 111), (3, 32000)])
def test_half_and_float32_give_the_same_kept_sets(rows, vocab):
    half = random_logits(rows, vocab, 31, ties=True).to(torch.bfloat16)
    params = [p.replace(logprobs=-1, logprobs_mode="processed_logits")
              for p in _params(rows, vocab, 31)]
    params[0] = params[0].replace(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05)
    outs = [sample_logits(x, params, max_logprobs=vocab) for x in (half, half.float())]
    processed = []
    for out in outs:
        full = torch.empty(rows, vocab)
        full.scatter_(1, out.topk_ids, out.topk_values)
        processed.append(full)
    assert torch.equal(torch.isfinite(processed[0]), torch.isfinite(processed[1]))
    assert torch.equal(processed[0], processed[1])
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    assert not torch.isfinite(processed[0]).all()  # the filters did drop tokens
