"""allowed_token_ids, bad words, min_tokens and logit_bias (docs/sampler.md §2 steps 2–5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams

from tests.sampler.helpers import oracle_rows, random_logits, run_sampler

NEG_INF = float("-inf")


@pytest.mark.parametrize("rows,vocab", [(1, 111), (7, 32000), (99, 111), (1, 151936)])
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


# -- the same items at odd sizes (issue 2: batch 1, 7, 99; vocab 111, 32000, 151936) ---------
ODD_SIZES = [(1, 151936), (7, 32000), (99, 111)]


def _bad_words_case(r, vocab, rng):
    """Row r's words, its output and the ids that must be banned.

    Every row has the word shapes (1,), (1,3) and (2,2): [a], [b, c, d], [c, f], [g, h]; the
    output's end (variant r % 7) matches some prefixes and not others. Row 0 matches the most.
    """
    a, b, c, d, f, g, h = (int(t) for t in rng.choice(vocab, size=7, replace=False))
    words = [[a], [b, c, d], [c, f], [g, h]]
    filler = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(0, 6)))]
    variants = [
        (filler + [b, c], {a, d, f}),   # (1,3) and one (2,2) prefix just generated
        (filler + [g], {a, h}),         # the other (2,2) prefix
        (filler + [c, b], {a}),         # prefixes in the wrong order
        ([], {a}),                      # no output yet: only the single-token word
        ([c], {a, f}),                  # too short for the 3-token word
        (filler + [b, c, -1], {a}),     # the last token is a placeholder: matches nothing
        (filler + [g, c], {a, f}),
    ]
    output, banned = variants[r % len(variants)]
    return words, output, banned


@pytest.mark.parametrize("rows,vocab", ODD_SIZES)
def test_bad_words_at_odd_sizes(rows, vocab):
    rng = np.random.default_rng(rows + vocab)
    cases = [_bad_words_case(r, vocab, rng) for r in range(rows)]
    words = [c[0] for c in cases]
    outputs = [c[1] for c in cases]
    logits = random_logits(rows, vocab, 5)
    for r, (_, _, banned) in enumerate(cases):
        logits[r, sorted(banned)] = 50.0  # greedy would pick a banned id if it were not banned
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 0.9, seed=r) for r in range(rows)]
    out, processed = run_sampler(logits, params, outputs=outputs, bad_words=words)
    for r, (_, _, banned) in enumerate(cases):
        assert set(torch.nonzero(torch.isinf(processed[r]))[:, 0].tolist()) == banned, r
        assert out.token_ids[r].item() not in banned
    oracle = oracle_rows(logits, params, outputs=outputs, bad_words=words)
    for r, res in enumerate(oracle):
        assert torch.equal(processed[r], torch.from_numpy(res.processed)), r
    assert out.token_ids.tolist() == [res.token_id for res in oracle]


@pytest.mark.parametrize("rows,vocab", ODD_SIZES)
def test_min_tokens_at_odd_sizes(rows, vocab):
    eos = [0, vocab - 1]
    rng = np.random.default_rng(rows * 3 + vocab)
    params, outputs, masked = [], [], []
    for r in range(rows):
        min_tokens = int(rng.choice([0, 2, 5]))
        stop = [int(t) for t in rng.choice(np.arange(1, vocab - 1), size=r % 3, replace=False)]
        params.append(SamplingParams(
            temperature=0.0 if r % 2 == 0 else 1.2, min_tokens=min_tokens, seed=r,
            stop_token_ids=stop, ignore_eos=bool(r % 4 == 1),
        ))
        done = int(rng.integers(0, 6)) if r else min_tokens - 1 if min_tokens else 1
        outputs.append([int(t) for t in rng.integers(1, vocab - 1, size=done)])
        masked.append(set(stop) | set(eos) if done < min_tokens else set())
    assert any(masked) or rows == 1 and params[0].min_tokens == 0
    logits = random_logits(rows, vocab, 6)
    for r, p in enumerate(params):
        logits[r, [*eos, *p.stop_token_ids]] = 40.0  # a stop id wins unless it is masked
    s = Sampler(rows, vocab, device="cpu", eos_token_ids=eos)
    for r, p in enumerate(params):
        s.add_request(r, p, [1], seed=r, output_token_ids=outputs[r])
    x = logits.clone()
    out = s.sample(x, list(range(rows)))
    for r in range(rows):
        assert set(torch.nonzero(torch.isinf(x[r]))[:, 0].tolist()) == masked[r], r
        if masked[r]:
            assert out.token_ids[r].item() not in masked[r]
    oracle = oracle_rows(logits, params, outputs=outputs, eos=eos)
    assert out.token_ids.tolist() == [res.token_id for res in oracle]
    for r, res in enumerate(oracle):
        assert torch.equal(x[r], torch.from_numpy(res.processed)), r
    # next step: each slot's position moved by one on the device; a row whose last masked
    # step that was is unmasked now (row 0 of a batch of one is such a row)
    x = logits.clone()
    s.sample(x, list(range(rows)))
    for r, p in enumerate(params):
        still = len(outputs[r]) + 1 < p.min_tokens
        assert set(torch.nonzero(torch.isinf(x[r]))[:, 0].tolist()) == (masked[r] if still
                                                                       else set()), r


@pytest.mark.parametrize("rows,vocab", ODD_SIZES)
def test_logit_bias_at_odd_sizes(rows, vocab):
    rng = np.random.default_rng(rows * 5 + vocab)
    logits = random_logits(rows, vocab, 7)
    values = [0.1, -3.25, 100.0, 1e-3, -1e30, 7.5, -0.0]
    bias = []
    for r in range(rows):
        if r % 4 == 3:
            bias.append({})
            continue
        ids = {0, vocab - 1} | {int(t) for t in rng.integers(0, vocab, size=5)}
        bias.append({t: float(rng.choice(values)) for t in ids})
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 0.7, logit_bias=b or None,
                             seed=r) for r, b in enumerate(bias)]
    out, processed = run_sampler(logits, params)
    oracle = oracle_rows(logits, params)
    for r, b in enumerate(bias):
        if params[r].temperature == 0:  # greedy rows end after steps 2-6: exactly x + bias
            expected = logits[r].clone()
            for t, v in b.items():
                expected[t] = expected[t] + torch.tensor(v, dtype=torch.float32)
            assert torch.equal(processed[r], expected), r
        assert torch.equal(processed[r], torch.from_numpy(oracle[r].processed)), r
    assert out.token_ids.tolist() == [res.token_id for res in oracle]
