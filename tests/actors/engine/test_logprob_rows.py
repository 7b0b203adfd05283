"""``LogprobRows`` appends each step's values, ranks and top-k rows to the right sequences'
lists, whether the step's logprob rows are the previous step's or changed."""

from __future__ import annotations

import numpy as np

from actors.engine.logprob_rows import LogprobRows
from actors.engine.sequence import Request, Sequence
from sampler.params import SamplingParams


def _seq(i: int, top: bool) -> Sequence:
    seq = Sequence(Request(i, [1, 2], SamplingParams(max_tokens=8), 0, i), 0, [1, 2])
    seq.logprobs, seq.sampled_ranks = [], []
    if top:
        seq.top_rows, seq.top_blocks = [], []
    return seq


def test_steps_with_the_same_and_with_changed_rows():
    rng = np.random.default_rng(0)
    seqs = [_seq(i, top=i % 2 == 0) for i in range(5)]
    steps = [(seqs, [0, 1, 2, 3, 4]), (list(seqs), [0, 1, 2, 3, 4]),
             ([seqs[0], seqs[2], seqs[3], seqs[4]], [1, 2, 4, 5]),  # seqs[1] left, rows moved
             ([seqs[0], seqs[2], seqs[3], seqs[4]], [1, 2, 4, 5]), ([seqs[3]], [0])]
    expected = {id(s): ([], [], []) for s in seqs}
    rows_log = LogprobRows()
    for step_seqs, rows in steps:
        values = rng.standard_normal(6).astype(np.float32)
        ranks = rng.integers(1, 9, 6)
        top_ids = rng.integers(0, 50, (6, 3))
        top_values = rng.standard_normal((6, 3)).astype(np.float32)
        rows_log.record(step_seqs, rows, values, ranks, top_ids, top_values)
        for seq, row in zip(step_seqs, rows):
            lp, rk, tops = expected[id(seq)]
            lp.append(float(values[row]))
            rk.append(int(ranks[row]))
            if seq.top_rows is not None:
                tops.append(top_ids[row].tolist())
    for seq in seqs:
        lp, rk, tops = expected[id(seq)]
        assert seq.logprobs == lp and seq.sampled_ranks == rk
        if seq.top_rows is not None:
            got = [block[0][j].tolist() for block, j in zip(seq.top_blocks, seq.top_rows)]
            assert got == tops
            # one block per step, shared by the step's top-k rows
            assert all(b is o for b, o in zip(seq.top_blocks, seqs[0].top_blocks))
        else:
            assert seq.top_rows is None
