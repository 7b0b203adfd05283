"""A seeded request gives the same tokens alone or among 40 other requests."""

from __future__ import annotations

import pytest

from sampler import SamplingParams
from tests.actors.helpers import make_engine, random_prompts


def test_seeded_request_independent_of_batch(tiny_llama):
    vocab = 512
    target_prompt = random_prompts([13], vocab, seed=50)[0]
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=100, max_tokens=20, seed=1234,
                            logprobs=2, ignore_eos=True)
    alone_engine = make_engine(tiny_llama, max_num_seqs=1)
    alone = alone_engine.generate([("t", target_prompt, target)])[0]

    others = random_prompts(list(range(1, 41)), vocab, seed=51)
    mix = [
        (f"o{i}", p, SamplingParams(temperature=[0.0, 0.7, 1.2][i % 3], max_tokens=5 + i % 17,
                                    seed=i, n=1 + i % 2, repetition_penalty=1.0 + (i % 4) / 10))
        for i, p in enumerate(others)
    ]
    crowd_engine = make_engine(tiny_llama, max_num_seqs=16, max_num_batched_tokens=48)
    # the target joins mid-way, in a different slot, with other rows around it
    outs = crowd_engine.generate(mix[:20] + [("t", target_prompt, target)] + mix[20:])
    crowded = next(o for o in outs if o.id == "t")
    assert len(outs) == 1 + sum(1 + i % 2 for i in range(40))
    assert crowded.output_token_ids == alone.output_token_ids
    assert crowded.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert crowded.seed == alone.seed == 1234

    # and a different seed gives a different stream
    other = alone_engine.generate([("t", target_prompt, target.replace(seed=4321))])[0]
    assert other.output_token_ids != alone.output_token_ids


def test_unseeded_requests_get_a_reported_reproducible_seed(tiny_llama):
    from sampler import derive_seed

    engine = make_engine(tiny_llama, seed=77)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first = engine.generate([("a", [5, 6, 7], params), ("b", [5, 6, 7], params)])
    assert first[0].seed == derive_seed(77, "a") and first[1].seed == derive_seed(77, "b")
    replay = engine.generate([("x", [5, 6, 7], params.replace(seed=first[0].seed))])[0]
    assert replay.output_token_ids == first[0].output_token_ids
    assert first[0].output_token_ids != first[1].output_token_ids


@pytest.mark.parametrize("seed", [1234, None])
def test_each_of_n_samples_reports_its_own_seed_and_reproduces_alone(tiny_llama, seed):
    from sampler.seeding import sample_seed

    prompt = random_prompts([9], 512, seed=52)[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=seed, logprobs=1,
                            ignore_eos=True)
    engine = make_engine(tiny_llama, max_num_seqs=4)
    samples = engine.generate([("r", prompt, params)])
    assert [o.sample_index for o in samples] == [0, 1, 2]
    seeds = [o.seed for o in samples]
    assert len(set(seeds)) == 3  # each sample its own seed ...
    assert seeds == [sample_seed(seeds[0], j) for j in range(3)]
    if seed is not None:
        assert seeds[0] == seed  # ... sample 0 keeps the request's
    assert len({tuple(o.output_token_ids) for o in samples}) == 3
    for o in samples:  # ... and n=1 with it reproduces the sample alone
        [alone] = engine.generate([("a", prompt, params.replace(n=1, seed=o.seed))])
        assert alone.output_token_ids == o.output_token_ids and alone.seed == o.seed
        assert alone.logprobs == pytest.approx(o.logprobs, abs=1e-5)
