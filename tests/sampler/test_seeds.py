"""Seed invariance: a row's draw depends only on (logits, params, seed, position, sample index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from sampler import Sampler, SamplingParams, derive_seed, sample_logits
from sampler.ops.gumbel import compute_gumbel_noise

from tests.sampler.helpers import random_logits

VOCAB = 32000
PARAMS = SamplingParams(temperature=1.5, seed=424242)  # many candidates
POSITIONS = [0, 17, 300]
SAMPLE_INDICES = [0, 3]

_SCRIPT = """
import json, sys, torch
from sampler import Sampler, SamplingParams
from sampler.ops.gumbel import compute_gumbel_noise
vocab, positions, indices = {vocab}, {positions}, {indices}
g = torch.Generator().manual_seed(1)
row = torch.randn(vocab, generator=g) * 3.0
params = SamplingParams(temperature=1.5, seed=424242)
tokens = []
for pos in positions:
    for j in indices:
        s = Sampler(1, vocab, device="cpu", eos_token_ids=[0])
        s.add_request(0, params, [5], seed=params.seed, sample_index=j, output_token_ids=[7] * pos)
        tokens.append(int(s.sample(row[None, :].clone(), [0]).token_ids[0]))
noise = compute_gumbel_noise(torch.tensor([424242]), torch.tensor([17]), torch.tensor([3]), vocab)
print(json.dumps({{"tokens": tokens, "noise": noise[0, :64].tolist()}}))
"""


def _row() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(VOCAB, generator=g) * 3.0


def _alone(pos: int, j: int) -> int:
    s = Sampler(1, VOCAB, device="cpu", eos_token_ids=[0])
    s.add_request(0, PARAMS, [5], seed=PARAMS.seed, sample_index=j, output_token_ids=[7] * pos)
    return int(s.sample(_row()[None, :].clone(), [0]).token_ids[0])


def _in_batch(pos: int, j: int, slot: int = 57) -> int:
    rows = 99
    s = Sampler(128, VOCAB, device="cpu", eos_token_ids=[0])
    others = random_logits(rows, VOCAB, pos * 10 + j)
    slots = [100 - r for r in range(rows)]  # our row sits at slot 57 (row 43)
    row = slots.index(slot)
    for r, sl in enumerate(slots):
        p = SamplingParams(temperature=0.5 + r % 3, top_k=r % 5, seed=derive_seed(3, r),
                           repetition_penalty=1.2, logprobs=2)
        if sl == slot:
            p = PARAMS
        s.add_request(sl, p, [5], seed=p.seed, sample_index=j if sl == slot else r % 4,
                      output_token_ids=[7] * (pos if sl == slot else r))
    others[row] = _row()
    return int(s.sample(others, slots).token_ids[row])


def test_same_row_same_token_alone_in_batch_and_in_another_process():
    alone = [_alone(p, j) for p in POSITIONS for j in SAMPLE_INDICES]
    batched = [_in_batch(p, j) for p in POSITIONS for j in SAMPLE_INDICES]
    assert alone == batched
    stateless = [
        int(sample_logits(_row()[None, :], [PARAMS], output_token_ids=[[7] * p],
                          sample_indices=[j]).token_ids[0])
        for p in POSITIONS for j in SAMPLE_INDICES
    ]
    assert stateless == alone
    code = _SCRIPT.format(vocab=VOCAB, positions=POSITIONS, indices=SAMPLE_INDICES)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    other = json.loads(run.stdout.strip().splitlines()[-1])
    assert other["tokens"] == alone
    here = compute_gumbel_noise(torch.tensor([424242]), torch.tensor([17]), torch.tensor([3]), VOCAB)
    assert other["noise"] == here[0, :64].tolist()


def test_the_draws_are_not_trivially_equal():
    # the positions / sample indices above do give different tokens (the test is not vacuous)
    assert len({_alone(p, j) for p in POSITIONS for j in SAMPLE_INDICES}) > 3


def test_different_seeds_give_different_streams():
    vocab = 2048
    row = _row()[None, :vocab].expand(200, vocab)
    streams = []
    for seed in (1, 2, 2**40 + 1):
        s = Sampler(200, vocab, device="cpu", eos_token_ids=[0])
        for slot in range(200):  # 200 positions of one stream, one slot each
            s.add_request(slot, PARAMS, [5], seed=seed, output_token_ids=[7] * slot)
        streams.append(s.sample(row.clone(), list(range(200))).token_ids)
    for a in range(3):
        for b in range(a + 1, 3):
            assert (streams[a] != streams[b]).float().mean() > 0.5
    # same seed again: same stream
    s = Sampler(200, vocab, device="cpu", eos_token_ids=[0])
    for slot in range(200):
        s.add_request(slot, PARAMS, [5], seed=1, output_token_ids=[7] * slot)
    assert torch.equal(s.sample(row.clone(), list(range(200))).token_ids, streams[0])


def test_stream_advances_with_the_output_position():
    s = Sampler(1, VOCAB, device="cpu", eos_token_ids=[0])
    s.add_request(0, PARAMS, [5], seed=PARAMS.seed, sample_index=3)
    stepped = [int(s.sample(_row()[None, :].clone(), [0]).token_ids[0]) for _ in range(18)]
    assert stepped[0] == _alone(0, 3) and stepped[1] == _alone(1, 3) and stepped[17] == _alone(17, 3)
