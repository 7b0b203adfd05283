"""A RolloutPool whose actor is a two-rank tensor-parallel replica (CPU, gloo): a placement
group of a bundle per rank, rank 1 a Ray actor in it; the sampled tokens of one rank, greedy
rollouts, full-tensor weight updates through Ray, sleep and wake on every rank, and nothing
left (actor, process, placement group) after shutdown."""

from __future__ import annotations

import time

import pytest
import torch

from tests.actors.engine.test_weights import hf_greedy, other_model
from tests.actors.helpers import random_prompts
from tests.jobs.helpers import alive_actor_classes, processes_gone

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 128, "max_model_len": 128, "seed": 7}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
SAMPLED = {"n": 2, "temperature": 0.9, "max_tokens": 6, "ignore_eos": True}
POOL_ACTORS = {"GenerationActor", "RankActor"}


def _replica_facts(actor) -> dict:
    """Rank 0's view of its replica, asked inside the actor: how its ranks were started, its
    placement group, its rank actors' placement groups and every rank's pid."""
    import ray

    def facts(generation_actor) -> dict:
        import os

        import ray

        replica = generation_actor.engine.replica
        group = ray.util.get_current_placement_group()
        return {"launcher": type(replica.ranks).__name__,
                "group": group.id.hex() if group is not None else None,
                "rank_groups": list(getattr(replica.ranks, "placement_groups", [])),
                "pids": [os.getpid(), *replica.pids]}

    return ray.get(actor.__ray_call__.remote(facts))


def _tokens(pool, prompts, params) -> list:
    return pool.generate(prompts, params).column("output_token_ids").to_pylist()


def test_tensor_parallel_pool_is_a_placement_group_of_rank_actors(ray_local, tiny_llama):
    import ray

    from toolkit import RolloutPool

    prompts = random_prompts([5, 12, 7], 500, seed=45)
    with RolloutPool(tiny_llama, num_actors=1, num_gpus_per_actor=0, engine=ENGINE) as one:
        sampled_one = _tokens(one, prompts, SAMPLED)

    pool = RolloutPool(tiny_llama, num_actors=1, num_gpus_per_actor=0,
                       engine={**ENGINE, "tensor_parallel_size": 2})
    try:
        assert pool.info()[0]["tensor_parallel_size"] == 2
        facts = _replica_facts(pool._actors[0])
        assert facts["launcher"] == "ActorRanks" and facts["rank_groups"] == [facts["group"]]
        group = ray.util.placement_group_table()[facts["group"]]
        assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
        assert list(group["bundles"].values()) == [{"CPU": 1.0}] * 2
        assert {"RankActor", "GenerationActor"} <= set(alive_actor_classes())
        assert _tokens(pool, prompts, SAMPLED) == sampled_one

        from transformers import AutoModelForCausalLM

        checkpoint = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        assert _tokens(pool, prompts, GREEDY) == [hf_greedy(checkpoint, p, 8) for p in prompts]
        first = other_model(tiny_llama, seed=0)
        pool.update_weights(first.state_dict(), chunk_bytes=100_000)  # several chunks
        want = [hf_greedy(first, p, 8) for p in prompts]
        assert _tokens(pool, prompts, GREEDY) == want
        assert pool.sleep(level=2)["weights"] > 0
        pool.wake_up()
        pool.update_weights(iter(first.state_dict().items()))
        pool.reset_prefix_cache()
        assert _tokens(pool, prompts, GREEDY) == want
    finally:
        pool.shutdown()
    assert ray.util.placement_group_table()[facts["group"]]["state"] == "REMOVED"
    assert processes_gone(facts["pids"])
    deadline = time.monotonic() + 10
    while POOL_ACTORS & set(alive_actor_classes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not POOL_ACTORS & set(alive_actor_classes())


def test_cpu_ranks_need_a_cpu_each(tiny_llama):
    from toolkit import RolloutPool

    with pytest.raises(ValueError, match=r"num_cpus_per_actor: must be > 0"):
        RolloutPool(tiny_llama, num_gpus_per_actor=0, num_cpus_per_actor=0,
                    engine={"tensor_parallel_size": 2})
