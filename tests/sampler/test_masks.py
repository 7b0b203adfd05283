"""allowed_token_ids, bad words, min_tokens and logit_bias (SAMPLER_SPEC §2 steps 2–5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams

from tests.sampler.helpers import oracle_rows, random_logits, run_sampler

NEG_INF = float("-inf")


@pytest.mark.parametrize("rows,vocab", [(1, 111), (7, 32000), (99, 111)])
def test_allowed_token_ids(rows, vocab):
    logits = random_logits(rows, vocab, 3)
    rng = np.random.default_rng(rows)
    params = []
    for r in range(rows):
        allowed = None
        if r % 2 == 0:
            allowed = rng.choice(vocab, size=1 + r % 9, replace=False).tolist()
        params.append(SamplingParams(temperature=0.0 if r % 3 else 1.0, seed=r,
                                     allowed_token_ids=allowed))
    out, processed = run_sampler(logits, params)
    for r, p in enumerate(params):
        finite = torch.isfinite(processed[r])
        if p.allowed_token_ids is None:
            assert finite.all()
        else:
            assert sorted(torch.nonzero(finite)[:, 0].tolist()) == sorted(p.allowed_token_ids)
            assert out.token_ids[r].item() in p.allowed_token_ids
            assert torch.equal(processed[r][finite], logits[r][finite])
    for res, r in zip(oracle_rows(logits, params), range(rows)):
        assert torch.equal(processed[r], torch.from_numpy(res.processed))


def test_allowed_mask_of_a_reused_slot_is_replaced():
    s = Sampler(2, 50, device="cpu", eos_token_ids=[0])
    s.add_request(1, SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), [], seed=0)
    x = torch.zeros(1, 50)
    s.sample(x, [1])
    assert torch.isfinite(x).sum() == 2
    s.remove_request(1)
    s.add_request(1, SamplingParams(temperature=0.0, allowed_token_ids=[7]), [], seed=0)
    x = torch.zeros(1, 50)
    assert s.sample(x, [1]).token_ids.item() == 7 and torch.isfinite(x).sum() == 1
    s.add_request(1, SamplingParams(temperature=0.0), [], seed=0)
    x = torch.zeros(1, 50)
    s.sample(x, [1])
    assert torch.isfinite(x).all()


# words are (prefix..., banned); outputs end with or without the prefix
BAD_WORD_CASES = {
    "(1,)": ([[9]], [1, 2], {9}),
    "(1,3) match": ([[9], [4, 5, 6]], [1, 4, 5], {9, 6}),
    "(1,3) no match": ([[9], [4, 5, 6]], [4, 1, 5], {9}),
    "(1,3) too short": ([[9], [4, 5, 6]], [5], {9}),
    "(2,2) both": ([[5, 8], [5, 3]], [2, 5], {8, 3}),
    "(2,2) one": ([[5, 8], [7, 3]], [2, 7], {3}),
    "(2,2) none": ([[5, 8], [7, 3]], [5, 2], set()),
    "(2,2) empty output": ([[5, 8], [7, 3]], [], set()),
    "(2,2) placeholder": ([[5, 8], [7, 3]], [7, -1], set()),
}


@pytest.mark.parametrize("case", list(BAD_WORD_CASES))
def test_bad_words(case):
    words, output, banned = BAD_WORD_CASES[case]
    vocab = 20
    logits = random_logits(1, vocab, 4)
    params = [SamplingParams(temperature=0.0, seed=0)]
    _, processed = run_sampler(logits, params, outputs=[output], bad_words=[words])
    assert set(torch.nonzero(torch.isinf(processed[0]))[:, 0].tolist()) == banned
    [res] = oracle_rows(logits, params, outputs=[output], bad_words=[words])
    assert torch.equal(processed[0], torch.from_numpy(res.processed))


def test_bad_words_follow_the_generated_tokens():
    # a 3-token word (4, 5, 6): 6 is banned exactly when the last two outputs are 4, 5
    vocab = 12
    s = Sampler(3, vocab, device="cpu", eos_token_ids=[0])
    s.add_request(2, SamplingParams(temperature=0.0), [1], seed=0, bad_words_token_ids=[[4, 5, 6]])
    s.add_request(0, SamplingParams(temperature=0.0), [1], seed=0,
                  bad_words_token_ids=[[3, 3, 3, 3, 3, 11]])  # a longer word: wider window
    script = [4, 5, 6, 6, 4, 5, 6]  # greedy picks the planted token unless it is banned
    got = []
    for want in script:
        x = torch.zeros(2, vocab)
        x[0, want] = 10.0
        got.append(s.sample(x, [2, 0]).token_ids[0].item())
    assert got == [4, 5, 0, 6, 4, 5, 0]  # banned right after (4, 5): the lowest zero wins
    x = torch.zeros(1, vocab)
    x[0, 6] = 10.0
    s.add_request(1, SamplingParams(temperature=0.0), [1], seed=0, output_token_ids=[4, 5],
                  bad_words_token_ids=[[4, 5, 6]])
    assert s.sample(x, [1]).token_ids.item() != 6  # re-admitted: the window comes from outputs


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab, eos = 30, [0, 29]
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    s = Sampler(1, vocab, device="cpu", eos_token_ids=eos)
    s.add_request(0, params, [1], seed=0)
    logits = torch.zeros(1, vocab)
    logits[0, [0, 29, 7]] = torch.tensor([9.0, 8.0, 7.0])
    logits[0, 12] = 1.0
    tokens = []
    for _ in range(5):
        x = logits.clone()
        tokens.append(s.sample(x, [0]).token_ids.item())
        if len(tokens) <= 3:
            assert torch.isinf(x[0, [0, 29, 7]]).all()  # EOS masked even under ignore_eos
    assert tokens == [12, 12, 12, 0, 0]
    # re-admission with 2 outputs already: one more masked step
    s.add_request(0, params, [1], seed=0, output_token_ids=[12, 12])
    assert [s.sample(logits.clone(), [0]).token_ids.item() for _ in range(2)] == [12, 0]
    [res] = oracle_rows(logits, [params], outputs=[[12, 12]], eos=eos)
    assert res.token_id == 12


def test_logit_bias_is_exact():
    vocab = 111
    logits = random_logits(3, vocab, 7)
    bias = [{0: 0.1, 5: -3.25, 110: 100.0}, {}, {42: 1e-3, 43: -1e30}]
    params = [SamplingParams(temperature=0.0, logit_bias=b or None, seed=0) for b in bias]
    _, processed = run_sampler(logits, params)
    for r, b in enumerate(bias):
        expected = logits[r].clone()
        for t, v in b.items():
            expected[t] = expected[t] + torch.tensor(v, dtype=torch.float32)
        assert torch.equal(processed[r], expected)
