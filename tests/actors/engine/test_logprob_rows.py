"""``LogprobRows`` hands each sequence the values, ranks and top-k rows of its own steps,
whether the step's logprob rows are the previous step's (one run) or changed (a new run),
and whenever the sequence is flushed."""

from __future__ import annotations

import numpy as np

from actors.engine.logprob_rows import LogprobRows
from actors.engine.sequence import Request, Sequence
from sampler.params import SamplingParams


def _seq(i: int, top: bool) -> Sequence:
    seq = Sequence(Request(i, [1, 2], SamplingParams(max_tokens=8), 0, i), 0, [1, 2])
    seq.logprobs, seq.sampled_ranks, seq.logprob_runs = [], [], []
    if top:
        seq.top_rows, seq.top_blocks = [], []
    return seq


def test_runs_of_same_and_changed_rows_reach_each_sequence():
    rng = np.random.default_rng(0)
    seqs = [_seq(i, top=i % 2 == 0) for i in range(5)]
    a, b = [seqs[0], seqs[2], seqs[3], seqs[4]], [1, 2, 4, 5]  # seqs[1] left, rows moved
    steps = [(seqs, [0, 1, 2, 3, 4]), (list(seqs), [0, 1, 2, 3, 4]), (a, b), (list(a), b),
             ([seqs[3], seqs[4]], [0, 1]), ([seqs[3], seqs[4]], [0, 1])]
    expected = {id(s): ([], [], []) for s in seqs}
    log = LogprobRows()
    for i, (step_seqs, rows) in enumerate(steps):
        values = rng.standard_normal(6).astype(np.float32)
        ranks = rng.integers(1, 9, 6)
        top_ids = rng.integers(0, 50, (6, 3))
        top_values = rng.standard_normal((6, 3)).astype(np.float32)
        log.record(step_seqs, rows, values, ranks, top_ids, top_values)
        for seq, row in zip(step_seqs, rows):
            lp, rk, tops = expected[id(seq)]
            lp.append(float(values[row]))
            rk.append(int(ranks[row]))
            if seq.top_rows is not None:
                tops.append(top_ids[row].tolist())
        if i == 1:
            log.flush(seqs[1])  # it finished in this step
        if i == 4:
            log.flush(seqs[4])  # flushed while its run is open (an abort)
    assert len(seqs[0].logprob_runs) == 2  # two runs, noted once each, no list grown yet
    assert seqs[0].logprobs == []
    for seq in seqs:
        log.flush(seq)
        lp, rk, tops = expected[id(seq)]
        assert seq.logprobs == lp and seq.sampled_ranks == rk and seq.logprob_runs == []
        if seq.top_rows is not None:
            got = [block[0][j].tolist() for block, j in zip(seq.top_blocks, seq.top_rows)]
            assert got == tops
        else:
            assert seq.top_rows is None
    # a step's block is shared by its top-k rows
    assert all(x is y for x, y in zip(seqs[0].top_blocks[:4], seqs[2].top_blocks[:4]))
