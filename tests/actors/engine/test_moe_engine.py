"""MoE models through the engine with the fused MoE path (``fused_moe=True``; on CPU the
kernels' torch references, and once the Triton kernels under the interpreter): greedy
outputs equal HF ``generate``, logits equal HF's forward, and the experts' weights load by
their Hugging Face names (update_weights, sleep level 2)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine
from sampler import SamplingParams
from tests.actors.engine.test_logits_parity import capture_logits
from tests.actors.engine.test_weights import GREEDY, greedy_outputs, hf_greedy, other_model
from tests.actors.helpers import hf_logits, make_engine, random_prompts

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]
MAX_NEW = 12


def _check_fused(engine: Engine, layers: int = 2) -> None:
    info = engine.info()["fused_moe"]
    assert info["experts"] == info["routers"] == layers and not info["kept"], info


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch, tiny_model_factory, hf_reference):
    path = tiny_model_factory(arch)
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=24, fused_moe=True)
    _check_fused(engine)
    prompts = random_prompts([1, 4, 9, 30, 13, 6], engine.loaded.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    ref = hf_reference(path)
    for out in outs:
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompts[out.id]]), do_sample=False,
                               max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                               pad_token_id=ref.generation_config.eos_token_id)
        assert out.output_token_ids == gen[0, len(prompts[out.id]):].tolist(), out.id


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_forward(arch, tiny_model_factory, hf_reference):
    path = tiny_model_factory(arch)
    engine = Engine(path, {"max_num_seqs": 3, "max_num_batched_tokens": 16, "block_size": 4,
                           "num_kv_blocks": 128, "max_model_len": 128, "fused_moe": True})
    _check_fused(engine)
    seen = capture_logits(engine)
    prompts = random_prompts([3, 21, 8], engine.loaded.vocab_size, seed=2)
    params = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    ref = hf_reference(path)
    worst = 0.0
    for out in outs:
        full = prompts[out.id] + out.output_token_ids
        rows = seen[(out.id, 0)]
        assert sorted(rows) == list(range(len(full) - 1))
        got = torch.stack([rows[p] for p in range(len(full) - 1)])
        worst = max(worst, float((got - hf_logits(ref, full)[:-1]).abs().max()))
    assert worst < 1e-4, f"{arch}: max |engine - HF| = {worst}"


def test_the_triton_kernels_through_the_engine(tiny_model_factory, hf_reference):
    """The kernels themselves (interpreted on CPU) in the engine's forward."""
    from actors.engine.model.moe import install_fused_moe

    path = tiny_model_factory("qwen3_moe")
    engine = make_engine(path, max_num_seqs=3, max_num_batched_tokens=16)
    assert engine.info()["fused_moe"] is None  # off by default on CPU
    fused = install_fused_moe(engine.loaded.model, "triton")
    assert len(fused.experts) == len(fused.routers) == 2
    prompts = random_prompts([2, 7, 19], engine.loaded.vocab_size, seed=9)
    ref = hf_reference(path)
    assert greedy_outputs(engine, prompts)[:3] == [hf_greedy(ref, p, GREEDY["max_tokens"])
                                                   for p in prompts]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 9], 500, seed=11)


def test_update_weights_and_sleep_address_the_experts_by_hf_names(tiny_model_factory, prompts):
    path = tiny_model_factory("qwen2_moe")
    engine = make_engine(path, fused_moe=True)
    _check_fused(engine)
    before = greedy_outputs(engine, prompts)
    second = other_model(path, seed=1)
    state = second.state_dict()
    assert any(".mlp.experts.gate_up_proj" in n for n in state)  # the HF names themselves
    want = [hf_greedy(second, p, GREEDY["max_tokens"]) for p in prompts]
    assert want != before
    engine.update_weights(state)
    assert greedy_outputs(engine, prompts) == want
    # sleep level 2 frees the experts too; loading the HF state dict brings them back
    engine.sleep(level=2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate([(0, prompts[0], GREEDY)])
    engine.update_weights(state)
    assert greedy_outputs(engine, prompts) == want


def test_the_fused_moe_option():
    from actors.engine.builder import resolve_fused_moe
    from actors.engine.engine_config import EngineConfig

    cpu = torch.device("cpu")
    assert resolve_fused_moe(EngineConfig(device="cpu"), cpu) is None  # default: HF modules
    assert resolve_fused_moe(EngineConfig(device="cpu", fused_moe=True), cpu) == "torch"
    assert resolve_fused_moe(EngineConfig(device="cpu", fused_moe=False), cpu) is None
    with pytest.raises(ValueError, match="fused_moe"):
        EngineConfig(fused_moe="yes")
