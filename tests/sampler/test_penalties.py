"""Repetition / frequency / presence penalties (docs/sampler.md §2 step 6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams, sample_logits

from tests.sampler.helpers import oracle_rows, random_logits, run_sampler


def _expected(row, prompt, output, r, f, p):
    x = row.numpy().astype(np.float32).copy()
    counts = {t: output.count(t) for t in set(output) if t >= 0}
    for t in set(prompt) | set(counts):
        x[t] = x[t] / np.float32(r) if x[t] > 0 else x[t] * np.float32(r)
    for t, c in counts.items():
        x[t] = x[t] - np.float32(f) * np.float32(c)
        x[t] = x[t] - np.float32(p)
    return torch.from_numpy(x)


def test_hand_made_counts():
    vocab = 10
    row = torch.tensor([[2.0, -2.0, 1.5, -1.0, 3.0, 0.5, -0.5, 0.0, 4.0, -3.0]])
    prompt = [1, 4, 4, 8]  # 1, 4, 8: repetition only
    output = [4, 5, 5, 5, 9, -1]  # 4 also in the prompt; -1 is a placeholder
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                       presence_penalty=0.25)
    _, processed = run_sampler(row, [p.replace(seed=0)], prompts=[prompt], outputs=[output])
    want = row[0].clone()
    want[1] = -2.0 * 1.5          # prompt only, negative: multiplied
    want[8] = 4.0 / 1.5           # prompt only, positive: divided
    want[4] = 3.0 / 1.5 - 0.5 - 0.25
    want[5] = 0.5 / 1.5 - 1.5 - 0.25
    want[9] = -3.0 * 1.5 - 0.5 - 0.25
    torch.testing.assert_close(processed[0], want, rtol=0, atol=1e-6)
    assert torch.equal(processed[0], _expected(row[0], prompt, output, 1.5, 0.5, 0.25))
    untouched = [0, 2, 3, 6, 7]
    assert torch.equal(processed[0, untouched], row[0, untouched])  # incl. the last id (-1)


def test_placeholder_is_never_counted():
    vocab = 16
    s = Sampler(2, vocab, device="cpu", eos_token_ids=[0])
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=1.0,
                       repetition_penalty=2.0)
    s.add_request(1, p, [], seed=0, output_token_ids=[-1, 3, -1])
    x = torch.full((1, vocab), 1.0)
    x[0, 3] = 9.0  # 9 / 2 - 1 * 1 - 1 = 2.5: still the argmax
    s.sample(x, [1])
    assert s.state.output_counts[1].tolist() == [0, 0, 0, 2] + [0] * 12  # 3 twice (output + sampled)
    assert x[0, vocab - 1].item() == 1.0  # -1 did not wrap around to the last id
    assert s.state.positions[1].item() == 4  # placeholders count in the position


@pytest.mark.parametrize("rows,vocab", [(1, 111), (7, 32000), (99, 111), (1, 151936)])
def test_random_penalties_match_oracle(rows, vocab):
    logits = random_logits(rows, vocab, rows)
    rng = np.random.default_rng(vocab)
    params, prompts, outputs = [], [], []
    for r in range(rows):
        params.append(SamplingParams(
            temperature=float(rng.choice([0.0, 0.8])),
            repetition_penalty=float(rng.choice([1.0, 0.7, 1.3])),
            frequency_penalty=float(rng.choice([0.0, -0.5, 1.1])),
            presence_penalty=float(rng.choice([0.0, 2.0, -2.0])),
            seed=r,
        ))
        prompts.append(rng.integers(0, vocab, size=rng.integers(0, 30)).tolist())
        outputs.append(rng.integers(-1, vocab, size=rng.integers(0, 30)).tolist())
    assert any(p.needs_penalties for p in params)  # the batch is not penalty-free
    out, processed = run_sampler(logits, params, prompts=prompts, outputs=outputs)
    oracle = oracle_rows(logits, params, prompts=prompts, outputs=outputs)
    for r, res in enumerate(oracle):
        if params[r].temperature == 0:
            want = _expected(logits[r], prompts[r], outputs[r], params[r].repetition_penalty,
                             params[r].frequency_penalty, params[r].presence_penalty)
            assert torch.equal(processed[r], want)
        assert torch.equal(processed[r], torch.from_numpy(res.processed))
    assert out.token_ids.tolist() == [res.token_id for res in oracle]


def test_counts_follow_sampled_tokens_on_the_device():
    vocab, steps = 40, 12
    s = Sampler(4, vocab, device="cpu", eos_token_ids=[0])
    p = SamplingParams(temperature=1.0, frequency_penalty=0.3, repetition_penalty=1.2, seed=5)
    s.add_request(3, p, [1, 2], seed=5, output_token_ids=[7, 7])
    s.add_request(0, SamplingParams(temperature=1.0), [1], seed=6)
    history = {3: [7, 7], 0: []}
    for step in range(steps):
        logits = random_logits(2, vocab, step)
        expected = sample_logits(logits, [p, SamplingParams(temperature=1.0, seed=6)],
                                 prompt_token_ids=[[1, 2], [1]],
                                 output_token_ids=[history[3], history[0]])
        out = s.sample(logits.clone(), [3, 0])
        assert torch.equal(out.token_ids, expected.token_ids)
        history[3].append(out.token_ids[0].item())
        history[0].append(out.token_ids[1].item())
    counts = np.bincount(history[3], minlength=vocab)
    assert s.state.output_counts[3].tolist() == counts.tolist()
