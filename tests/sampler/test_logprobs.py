"""Logprob modes, ranks and top-k (docs/sampler.md §3)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from sampler import LOGPROBS_MODES, AsyncOutput, Sampler, SamplingParams, sample_logits

from tests.sampler.helpers import assert_matches_oracle, oracle_rows, random_logits, run_sampler


def _definition(mode, raw, processed, params):
    t = 1.0 if params.temperature == 0 else params.temperature
    return {
        "raw_logprobs": torch.log_softmax(raw.float(), -1),
        "raw_logits": raw.float(),
        "temperature_logprobs": torch.log_softmax(raw.float() / t, -1),
        "processed_logprobs": torch.log_softmax(processed, -1),
        "processed_logits": processed,
    }[mode]


def _batch(rows, vocab, seed, k_choices=(-1,)):
    rng = random.Random(seed)
    logits = random_logits(rows, vocab, seed, ties=bool(seed % 2))
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.6, 1.0, 1.9]), top_k=rng.choice([0, 3, 50]),
            top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]),
            logprobs=rng.choice(k_choices), logprobs_mode=LOGPROBS_MODES[r % 5],
            repetition_penalty=rng.choice([1.0, 1.3]), seed=rng.randrange(2**63),
        )
        for r in range(rows)
    ]
    prompts = [[rng.randrange(vocab) for _ in range(5)] for _ in range(rows)]
    return logits, params, prompts


@pytest.mark.parametrize("rows,vocab", [(7, 111), (5, 32000), (7, 151936)])
def test_each_mode_equals_its_definition(rows, vocab):
    logits, params, prompts = _batch(rows, vocab, rows)
    raw = logits.clone()
    out, processed = run_sampler(logits, params, prompts=prompts)
    assert torch.equal(logits, raw)  # run_sampler works on a copy
    for r, p in enumerate(params):
        want = _definition(p.logprobs_mode, raw[r], processed[r], p)
        ids, vals = out.topk_ids[r], out.topk_values[r]
        assert sorted(ids.tolist()) == list(range(vocab))  # logprobs=-1: the whole vocab
        got = torch.empty(vocab)
        got[ids] = vals
        assert torch.equal(got, want), p.logprobs_mode
        token = out.token_ids[r]
        assert out.logprobs[r] == want[token]
        assert out.ranks[r] == 1 + (want > want[token]).sum()
        # order: values descending, ties by lower id
        assert (vals[1:] <= vals[:-1]).all()
        tie = vals[1:] == vals[:-1]
        assert (ids[1:][tie] > ids[:-1][tie]).all()
        if p.logprobs_mode.endswith("logprobs"):
            assert (vals <= 0).all()


@pytest.mark.parametrize("rows,vocab", [(1, 111), (7, 32000), (99, 111), (1, 151936),
                                       (7, 151936)])
def test_logprobs_match_oracle(rows, vocab):
    logits, params, prompts = _batch(rows, vocab, 100 + rows, k_choices=(None, 0, 1, 5, 20))
    if all(p.logprobs is None for p in params):  # a batch of one may have drawn "off"
        params[0] = params[0].replace(logprobs=5)
    out, _ = run_sampler(logits, params, prompts=prompts)
    assert_matches_oracle(out, oracle_rows(logits, params, prompts=prompts), params)


def test_top_k_width_padding_and_rows_without_logprobs():
    logits = random_logits(4, 111, 1, ties=True)
    params = [SamplingParams(logprobs=3, seed=1), SamplingParams(seed=2),
              SamplingParams(logprobs=0, seed=3), SamplingParams(logprobs=7, seed=4)]
    out, _ = run_sampler(logits, params)
    assert out.topk_ids.shape == (4, 7) and out.topk_values.shape == (4, 7)
    assert (out.topk_ids[0, 3:] == -1).all() and torch.isneginf(out.topk_values[0, 3:]).all()
    assert (out.topk_ids[1] == -1).all() and (out.topk_ids[2] == -1).all()
    assert (out.topk_ids[3] >= 0).all()
    assert math.isnan(out.logprobs[1]) and out.ranks[1] == 0
    assert not math.isnan(out.logprobs[2]) and out.ranks[2] >= 1
    only_zero, _ = run_sampler(logits[:1], [SamplingParams(logprobs=0, seed=1)])
    assert only_zero.topk_ids is None and only_zero.logprobs is not None
    none, _ = run_sampler(logits[:1], [SamplingParams(seed=1)])
    assert none.logprobs is None and none.ranks is None and none.topk_ids is None


def test_top_k_ties_are_ordered_by_id():
    x = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0, -1.0]])
    out = sample_logits(x, [SamplingParams(temperature=0.0, logprobs=4,
                                           logprobs_mode="raw_logits")])
    assert out.topk_ids[0].tolist() == [1, 3, 5, 2]
    assert out.topk_values[0].tolist() == [2.0, 2.0, 2.0, 1.0]
    assert out.token_ids.item() == 1 and out.ranks.item() == 1
    # rank counts only strictly greater values: a tied token is rank 1 as well
    out = sample_logits(x, [SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="raw_logits",
                                           allowed_token_ids=[3, 4])])
    assert out.token_ids.item() == 3 and out.ranks.item() == 1
    out = sample_logits(x, [SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="raw_logits",
                                           allowed_token_ids=[4, 6])])
    assert out.token_ids.item() == 4 and out.ranks.item() == 4  # three 2.0 above it


def test_cumulative_logprob_is_the_sum_of_steps():
    vocab, steps = 500, 25
    s = Sampler(2, vocab, device="cpu", eos_token_ids=[0])
    p = SamplingParams(temperature=0.9, top_p=0.9, logprobs=2, seed=77)
    s.add_request(1, p, [3, 4], seed=77)
    total, reference = 0.0, 0.0
    for step in range(steps):
        logits = random_logits(1, vocab, 300 + step)
        host = AsyncOutput(s.sample(logits.clone(), [1])).get()
        total += float(host.logprobs[0])
        reference += float(torch.log_softmax(logits[0].double(), -1)[host.token_ids[0]])
        assert host.logprobs[0] <= 0
    assert total == pytest.approx(reference, abs=1e-4)


def test_processed_logprobs_renormalise_over_survivors():
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=1.0, top_k=2, logprobs=-1, logprobs_mode="processed_logprobs",
                       seed=0)
    out = sample_logits(x, [p])
    got = dict(zip(out.topk_ids[0].tolist(), out.topk_values[0].tolist()))
    z = math.log(math.exp(3.0) + math.exp(2.0))
    assert got[0] == pytest.approx(3.0 - z) and got[1] == pytest.approx(2.0 - z)
    assert got[2] == -math.inf and got[3] == -math.inf
    assert np.exp([got[0], got[1]]).sum() == pytest.approx(1.0)


def test_temperature_logprobs_use_temperature_and_one_for_greedy():
    x = random_logits(2, 50, 3)
    params = [SamplingParams(temperature=0.5, logprobs=0, logprobs_mode="temperature_logprobs",
                             seed=1),
              SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="temperature_logprobs")]
    out = sample_logits(x, params)
    assert out.logprobs[0] == torch.log_softmax(x[0] / 0.5, -1)[out.token_ids[0]]
    assert out.logprobs[1] == torch.log_softmax(x[1], -1)[out.token_ids[1]]
