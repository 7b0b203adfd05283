"""A RolloutPool whose actor is a two-rank tensor-parallel replica (CPU, gloo): greedy
rollouts, full-tensor weight updates through Ray, sleep and wake on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.actors.engine.test_weights import hf_greedy, other_model
from tests.actors.helpers import random_prompts

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 128, "max_model_len": 128,
          "tensor_parallel_size": 2}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def test_tensor_parallel_pool_rounds(ray_local, tiny_llama):
    from toolkit import RolloutPool

    pool = RolloutPool(tiny_llama, num_actors=1, num_gpus_per_actor=0, engine=ENGINE)
    try:
        assert pool.info()[0]["tensor_parallel_size"] == 2
        prompts = random_prompts([5, 12, 7], 500, seed=45)

        def greedy():
            return pool.generate(prompts, GREEDY).column("output_token_ids").to_pylist()

        from transformers import AutoModelForCausalLM

        checkpoint = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        assert greedy() == [hf_greedy(checkpoint, p, 8) for p in prompts]
        first = other_model(tiny_llama, seed=0)
        pool.update_weights(first.state_dict(), chunk_bytes=100_000)  # several chunks
        want = [hf_greedy(first, p, 8) for p in prompts]
        assert greedy() == want
        assert pool.sleep(level=2)["weights"] > 0
        pool.wake_up()
        pool.update_weights(iter(first.state_dict().items()))
        assert greedy() == want
    finally:
        pool.shutdown()
