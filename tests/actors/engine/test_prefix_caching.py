"""n samples compute their prompt once; prefix caching reuses full blocks across requests
without changing any seeded output; prompt-logprob requests still score cached positions."""

from __future__ import annotations

import pytest

from sampler import SamplingParams
from sampler.seeding import sample_seed
from tests.actors.helpers import by_id, make_engine, random_prompts


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("length", [37, 32])  # partial last block (copied) / full blocks only
def test_n_samples_compute_the_prompt_once(tiny_llama, caching, length):
    engine = make_engine(tiny_llama, enable_prefix_caching=caching, block_size=16,
                         max_num_batched_tokens=16)  # the prompt takes several chunks
    prompt = random_prompts([length], engine.loaded.vocab_size, seed=21)[0]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
    runner = engine.executor.runner
    fed = []
    original = runner.execute

    def execute(inputs, prev):
        fed.append(len(inputs.input_ids))
        return original(inputs, prev)

    runner.execute = execute
    outs = engine.generate([("r", prompt, params)])
    assert engine.stats.num_prompt_tokens_computed == length
    assert sum(fed) == length + 8 * 11  # the prompt once, then 11 decode inputs per sample
    assert [o.sample_index for o in outs] == list(range(8))
    assert all(o.num_output_tokens == 12 for o in outs)
    assert [o.seed for o in outs] == [sample_seed(4, j) for j in range(8)]  # each its own
    # eight independent noise streams from one logits row
    assert len({tuple(o.output_token_ids) for o in outs}) == 8
    assert len({o.output_token_ids[0] for o in outs}) > 1
    engine.scheduler.bm.check_invariants()
    assert engine.scheduler.bm.num_free_blocks == engine.kv_cache.num_blocks

    # sample j of n is the n=1 request with sample j's seed; a repeated request repeats them
    for j in (0, 5):
        solo = engine.generate([("r", prompt, params.replace(n=1, seed=outs[j].seed))])[0]
        assert solo.output_token_ids == outs[j].output_token_ids
    assert [o.output_token_ids for o in engine.generate([("r", prompt, params)])] == \
        [o.output_token_ids for o in outs]


def test_prefix_cache_hits_do_not_change_seeded_outputs(tiny_llama):
    vocab = 512
    system = random_prompts([50], vocab, seed=30)[0]          # shared "system prompt"
    suffixes = random_prompts([3, 8, 15, 1, 22, 6, 11, 4], vocab, seed=31)
    requests = [
        (i, system + s, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=100 + i,
                                       logprobs=1, n=1 + i % 3))
        for i, s in enumerate(suffixes)
    ]
    results = {}
    for caching in (True, False):
        engine = make_engine(tiny_llama, enable_prefix_caching=caching, max_num_seqs=4)
        results[caching] = (by_id(engine.generate(requests)), engine.stats)
    cached, plain = results[True][0], results[False][0]
    assert cached.keys() == plain.keys()
    for key in plain:
        assert cached[key].output_token_ids == plain[key].output_token_ids, key
        assert cached[key].logprobs == pytest.approx(plain[key].logprobs, abs=1e-5)
    stats_on, stats_off = results[True][1], results[False][1]
    assert stats_off.num_cached_prompt_tokens == 0
    assert stats_on.num_cached_prompt_tokens >= 48 * 3  # later waves reuse the system blocks
    assert stats_on.num_prompt_tokens_computed + stats_on.num_cached_prompt_tokens == \
        stats_off.num_prompt_tokens_computed


def test_prompt_logprobs_request_scores_cached_positions(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4)
    prompt = random_prompts([30], engine.loaded.vocab_size, seed=33)[0]
    engine.generate([("warm", prompt, SamplingParams(max_tokens=2, seed=0))])
    before = engine.stats.num_prompt_tokens_computed
    out = engine.generate([("lp", prompt, SamplingParams(max_tokens=2, seed=0,
                                                         prompt_logprobs=0))])[0]
    assert engine.stats.num_prompt_tokens_computed - before == 30  # nothing skipped
    assert engine.stats.num_cached_prompt_tokens == 0
    assert out.prompt_logprobs[0] is None
    assert all(v is not None for v in out.prompt_logprobs[1:])
    fresh = make_engine(tiny_llama, enable_prefix_caching=False)
    ref = fresh.generate([("lp", prompt, SamplingParams(max_tokens=2, seed=0,
                                                        prompt_logprobs=0))])[0]
    assert out.prompt_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)
    # and a plain request after it hits the cache again
    engine.generate([("again", prompt, SamplingParams(max_tokens=2, seed=0))])
    assert engine.stats.num_cached_prompt_tokens == 28  # 7 full blocks of 4
