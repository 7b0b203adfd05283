"""The sampler's step-plan cache: the plan of a step equals a fresh ``make_plan`` after any
sequence of admissions, removals, batch changes and steps, and a steady batch reuses it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import sampler.step_plan as plan_module
from sampler import Sampler, SamplingParams
from sampler.step_plan import PlanCache, make_plan

VOCAB = 64
CHOICES = (
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_k=5, logprobs=3),
    dict(temperature=0.7, min_p=0.1, min_tokens=3),
    dict(temperature=0.0, min_tokens=6, logprobs=0),
    dict(temperature=1.0, repetition_penalty=1.2, seed=11),
    dict(temperature=0.9, logit_bias={3: 2.0}, logprobs=2, logprobs_mode="raw_logits"),
)


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=50, **rng.choice(CHOICES))


@pytest.mark.parametrize("seed", range(4))
def test_the_cached_plan_is_always_the_fresh_plan(seed, monkeypatch):
    calls = []
    real = plan_module.make_plan
    monkeypatch.setattr(plan_module, "make_plan", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(seed)
    sampler = Sampler(8, VOCAB, device="cpu", eos_token_ids=[0])
    cache = PlanCache()
    live: set[int] = set()
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(seed))
    batch: list[int] = []
    last = None  # (requests changed since, batch) of the previous step
    misses = steps = 0
    changed = True
    for _ in range(150):
        event = rng.random()
        if event < 0.1 and len(live) < 8:  # admit
            slot = rng.choice(sorted(set(range(8)) - live))
            sampler.add_request(slot, _params(rng), [1, 2, 3], seed=rng.randrange(2**40))
            live.add(slot)
            changed = True
        elif event < 0.17 and live:  # finish
            slot = rng.choice(sorted(live))
            sampler.remove_request(slot)
            live.discard(slot)
            changed = True
        if event < 0.25 or not set(batch) <= live:  # a new batch (subset, any order)
            batch = rng.sample(sorted(live), rng.randint(0, len(live))) if live else []
        if not batch:
            continue
        rows = np.array(batch, np.int64)
        misses += changed or last != batch
        steps += 1
        assert cache.get(sampler.state, rows) == real(sampler.state, rows)
        sampler.sample(logits[:len(batch)].clone(), batch)  # advances the positions
        changed, last = False, list(batch)
    # both caches (the test's and the sampler's) plan anew exactly when the requests or the
    # batch changed; every other step reused the plan
    assert len(calls) == 2 * misses and misses < steps / 2


def test_a_steady_batch_plans_once_and_follows_min_tokens(monkeypatch):
    calls = []
    real = plan_module.make_plan
    monkeypatch.setattr(plan_module, "make_plan", lambda *a: calls.append(1) or real(*a))
    sampler = Sampler(4, VOCAB, device="cpu", eos_token_ids=[0])
    sampler.add_request(0, SamplingParams(temperature=0.0, min_tokens=2), [1], seed=1)
    sampler.add_request(1, SamplingParams(temperature=0.8), [1], seed=2)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(4):
        seen.append(sampler._plans.get(sampler.state, np.array([0, 1])).do_min_tokens)
        sampler.sample(logits.clone(), [0, 1])
    assert seen == [True, True, False, False]
    assert len(calls) == 1  # the sampler's own steps reused the first plan
    sampler.add_request(2, SamplingParams(temperature=0.0), [1], seed=3)  # the state changed
    sampler.sample(logits.clone(), [0, 1])
    assert len(calls) == 2
    sampler.sample(logits.clone(), [1, 0])  # another batch order
    assert len(calls) == 3
