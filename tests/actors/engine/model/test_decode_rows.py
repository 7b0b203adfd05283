"""A step that decodes exactly the in-flight step's sample rows reuses their arrays
(``DecodeRows``); its inputs equal those built from the sequences, through admissions,
forks, finishes and preemptions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sampler import SamplingParams
from tests.actors.helpers import make_engine, random_prompts


def _rebuilt(runner, sched):
    """The step's inputs built from the sequences (no in-flight rows), the recorded rows
    kept as they were."""
    rows = runner.rows
    kept = (rows.seqs, rows.slots, rows.lens)
    inputs = runner.prepare(sched, None)
    rows.record(*kept)
    return inputs


@pytest.mark.parametrize("tight", [False, True])
def test_reused_rows_equal_rows_built_from_the_sequences(tiny_llama, tight):
    prompts = random_prompts([12, 5, 20, 9, 3, 16, 7, 11, 4, 6], 512, seed=5)
    requests = [(i, p, SamplingParams(temperature=1.0, max_tokens=6 + 3 * i, seed=i,
                                      ignore_eos=True, n=2 if i == 3 else 1))
                for i, p in enumerate(prompts)]
    options = ({"num_kv_blocks": 14, "block_size": 4, "max_model_len": 52} if tight
               else {"max_num_seqs": 6})
    engine = make_engine(tiny_llama, **options)
    runner = engine.executor.runner
    prepare = runner.prepare
    reused = []

    def checking_prepare(sched, inflight=None):
        continues = runner.rows.continues(sched.seqs, sched.num_tokens, inflight)
        expected = _rebuilt(runner, sched) if continues else None
        inputs = prepare(sched, inflight)
        if continues:
            reused.append(len(sched.seqs))
            for f in dataclasses.fields(inputs):
                got, want = getattr(inputs, f.name), getattr(expected, f.name)
                if isinstance(want, np.ndarray):
                    assert got.dtype == want.dtype and np.array_equal(got, want), f.name
                else:
                    assert got == want, f.name
        return inputs

    runner.prepare = checking_prepare
    outs = engine.generate(requests)
    assert len(outs) == 11 and all(o.finish_reason == "length" for o in outs)
    assert len(reused) > 10  # the steady steps took the reuse path
    assert (engine.stats.num_preemptions > 0) == tight


def test_rows_are_not_reused_without_the_recorded_step_in_flight(tiny_llama):
    engine = make_engine(tiny_llama)
    rows = engine.executor.runner.rows
    engine.add_request(0, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    recorded = rows.seqs
    assert recorded is not None and len(recorded) == 1
    assert rows.continues(list(recorded), 1, recorded)
    assert not rows.continues(list(recorded), 1, None)            # nothing in flight
    assert not rows.continues(list(recorded), 1, list(recorded))  # another step in flight
    assert not rows.continues(list(recorded), 2, recorded)        # not one token a row
    assert not rows.continues([], 0, recorded)
