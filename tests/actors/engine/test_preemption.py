"""With a KV cache too small for the batch, sequences are preempted and recomputed; every
request completes and seeded outputs equal an unconstrained run."""

from __future__ import annotations

import pytest

from sampler import SamplingParams
from tests.actors.helpers import by_id, make_engine, random_prompts


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_complete_with_identical_outputs(tiny_llama, caching):
    vocab = 512
    prompts = random_prompts([12, 5, 20, 9, 3, 16, 7, 11], vocab, seed=40)
    requests = [
        (i, p, SamplingParams(temperature=1.0, top_k=50, max_tokens=30, seed=7 + i,
                              ignore_eos=True, logprobs=0, n=2 if i == 2 else 1))
        for i, p in enumerate(prompts)
    ]
    roomy = make_engine(tiny_llama, max_model_len=64, enable_prefix_caching=caching)
    expected = by_id(roomy.generate(requests))
    assert roomy.stats.num_preemptions == 0

    # 14 blocks of 4 tokens: one sequence of 50 tokens needs 13 of them
    tight = make_engine(tiny_llama, max_model_len=52, num_kv_blocks=14, block_size=4,
                        enable_prefix_caching=caching)
    got = by_id(tight.generate(requests))
    assert tight.stats.num_preemptions > 0
    assert got.keys() == expected.keys()
    for key, out in got.items():
        assert out.finish_reason == "length"
        assert out.output_token_ids == expected[key].output_token_ids, key
        assert out.logprobs == pytest.approx(expected[key].logprobs, abs=1e-5)
    bm = tight.scheduler.bm
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(tight.scheduler.free_slots) == list(range(tight.config.max_num_seqs))


@pytest.mark.parametrize("caching", [True, False])
def test_every_step_sees_each_sequence_s_current_block_table(tiny_llama, caching):
    """The runner refreshes its block-table mirror only for the sequences the scheduler lists
    (admitted, forked, given pages): under preemption, forks and prefix hits, every row of
    every step's table still equals its sequence's pages."""
    prompts = random_prompts([12, 5, 20, 9, 3, 16, 7, 11, 12, 12], 512, seed=41)
    prompts[9] = list(prompts[8])  # a prefix hit when caching
    # n=3 on prompts of 5 and 9 tokens: forks copy a partly filled last page
    requests = [(i, p, SamplingParams(temperature=1.0, max_tokens=30, seed=i, ignore_eos=True,
                                      n=3 if i in (1, 3) else 1))
                for i, p in enumerate(prompts)]
    engine = make_engine(tiny_llama, max_model_len=52, num_kv_blocks=16, block_size=4,
                         enable_prefix_caching=caching)
    runner = engine.executor.runner
    prepare = runner.prepare
    checked = []

    def checking_prepare(sched, *args):
        inputs = prepare(sched, *args)
        for i, seq in enumerate(sched.seqs):
            pages = seq.block_table
            row = inputs.block_tables[i]
            assert row[:len(pages)].tolist() == pages, (seq.seq_id, row, pages)
            assert not row[len(pages):].any()
        checked.append(len(sched.seqs))
        return inputs

    runner.prepare = checking_prepare
    outs = engine.generate(requests)
    assert len(outs) == 14 and all(o.finish_reason == "length" for o in outs)
    assert engine.stats.num_preemptions > 0 and len(checked) > 30
