"""A wave of finished sequences gathers its top logprobs per step for the whole group; the
result equals each sequence's own rows of the step blocks."""

from __future__ import annotations

import numpy as np

from actors.engine.output_processor import OutputProcessor
from actors.engine.generation_output import TopLogprobs
from actors.engine.sequence import Request, Sequence
from sampler import SamplingParams


def _seq(k: int) -> Sequence:
    request = Request("r", [1, 2, 3], SamplingParams(logprobs=k, max_tokens=50), 0, 0)
    seq = Sequence(request, 0, [1, 2, 3])
    seq.top_rows, seq.top_blocks = [], []
    return seq


def test_group_gather_equals_the_per_sequence_gather():
    rng = np.random.default_rng(0)
    processor = OutputProcessor(None, max_model_len=100, vocab_size=1000)
    wave = [_seq(k) for k in (5, 20, 1, 20, 5)]
    late = [_seq(20), _seq(3)]      # joined two steps later: a group of their own
    alone = _seq(7)                 # missed a step (preempted): a group of one
    for step in range(12):
        members = wave + (late if step >= 2 else []) + ([alone] if step != 4 else [])
        width = 20 if step % 3 else 24  # a step's width is its largest k (at least ours)
        rows = rng.permutation(len(members) + 3)[:len(members)]
        block = (rng.integers(0, 1000, (len(members) + 3, width)),
                 rng.standard_normal((len(members) + 3, width)).astype(np.float32))
        for seq, row in zip(members, rows):
            seq.top_blocks.append(block)
            seq.top_rows.append(int(row))
    unsampled = _seq(4)             # aborted before its first step
    everyone = wave + late + [alone, unsampled]
    tops = processor.top_logprobs_of(everyone)
    assert set(tops) == {id(s) for s in everyone}
    for seq in everyone:
        k = seq.request.params.logprobs
        expected = TopLogprobs(  # this sequence's row of each step's block, one at a time
            np.array([ids[r, :k] for (ids, _), r in zip(seq.top_blocks, seq.top_rows)],
                     np.int64).reshape(-1, k),
            np.array([vals[r, :k] for (_, vals), r in zip(seq.top_blocks, seq.top_rows)],
                     np.float32).reshape(-1, k))
        assert tops[id(seq)].token_ids.shape == (len(seq.top_blocks), k)
        assert tops[id(seq)] == expected
        assert processor.build(seq).top_logprobs == expected  # gathered alone
