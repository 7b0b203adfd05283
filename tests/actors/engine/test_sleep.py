"""Engine.sleep / wake_up: KV pages (level 1) and weights (level 2) freed and restored."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.actors.helpers import make_engine, random_prompts
from tests.actors.engine.test_weights import GREEDY, greedy_outputs, no_disk_reads


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([33, 6, 20], 500, seed=21)


def test_level_1_frees_the_kv_pages_and_wake_up_restores_generation(tiny_llama, prompts):
    engine = make_engine(tiny_llama)
    before = greedy_outputs(engine, prompts)
    pool = weakref.ref(engine.kv_cache.pool)
    kv_bytes = engine.kv_cache.nbytes
    freed = engine.sleep(1)  # right after generate: a step may still be in flight
    gc.collect()
    assert freed == {"kv_cache": kv_bytes, "weights": 0}
    assert pool() is None  # nothing holds the old pages
    assert engine.kv_cache.is_released and engine.info()["sleep_level"] == 1
    with pytest.raises(RuntimeError, match="asleep; call wake_up"):
        engine.generate([(0, prompts[0], GREEDY)])
    assert engine.sleep(1) == {"kv_cache": 0, "weights": 0}  # already asleep
    cached = engine.stats.num_cached_prompt_tokens
    with no_disk_reads():
        engine.wake_up()
        assert greedy_outputs(engine, prompts) == before
    assert engine.stats.num_cached_prompt_tokens == cached  # the lost pages are not "cached"
    assert engine.info()["sleep_level"] == 0


def test_level_2_frees_the_weights_until_they_are_loaded_again(tiny_llama, prompts):
    engine = make_engine(tiny_llama)
    before = greedy_outputs(engine, prompts)
    model = engine.loaded.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    freed = engine.sleep(level=2)
    assert freed["weights"] == weight_bytes and freed["kv_cache"] == engine.kv_cache.nbytes
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights(state)
    with no_disk_reads():
        engine.wake_up(["weights"])  # weights first: load them before the KV pages return
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate([(0, prompts[0], GREEDY)])
        engine.wake_up(["kv_cache"])
        with pytest.raises(RuntimeError, match=r"discarded by sleep\(level=2\).*update_weights"):
            engine.generate([(0, prompts[0], GREEDY)])
        half = dict(list(state.items())[: len(state) // 2])
        engine.update_weights(half)
        with pytest.raises(RuntimeError, match="discarded"):  # still some missing
            engine.generate([(0, prompts[0], GREEDY)])
        engine.update_weights({k: v for k, v in state.items() if k not in half})
        assert greedy_outputs(engine, prompts) == before


def test_sleep_refuses_a_busy_engine_and_bad_arguments(tiny_llama, prompts):
    engine = make_engine(tiny_llama)
    engine.add_request("r", prompts[0], GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.sleep()
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)
    engine.sleep()
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(["kv"])
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up("weights")
    engine.wake_up()
    assert not engine.memory.is_sleeping


GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)  # head_dim 64: FlashInfer and CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sleep_returns_the_kv_memory_and_graphs_are_recaptured(tiny_model_factory,
                                                                   prompts):
    """On CUDA: >= 90% of the KV pool shows up as free device memory after sleep(), and the
    decode graphs captured again at wake-up give the same outputs, also after level 2."""
    path = tiny_model_factory("qwen2", **GPU_SHAPE)
    engine = make_engine(path, device="cuda", dtype="bfloat16", num_kv_blocks=65536)
    graphs = engine.info()["cuda_graphs"]
    before = greedy_outputs(engine, prompts)
    state = {k: v.clone() for k, v in engine.loaded.model.state_dict().items()}
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    freed = engine.sleep(1)
    free1, _ = torch.cuda.mem_get_info()
    assert free1 - free0 >= 0.9 * freed["kv_cache"] > 0
    engine.wake_up()
    assert engine.info()["cuda_graphs"] == graphs
    assert greedy_outputs(engine, prompts) == before
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(state)
    assert engine.info()["cuda_graphs"] == graphs
    assert greedy_outputs(engine, prompts) == before
