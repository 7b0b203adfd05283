"""Engine.update_weights: in place, from a state dict / payload / iterator of pairs, tied and
sharded checkpoints, checked names/shapes/dtypes, prefix cache reset, never from disk."""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import pytest
import torch

from actors.engine.weights import WeightPayload, pack_weights
from tests.actors.helpers import make_engine, random_prompts

GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def other_model(path: str, seed: int) -> torch.nn.Module:
    """The model at ``path`` with every weight redrawn (a second model of the same shape)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@contextlib.contextmanager
def no_disk_reads():
    """Any attempt to read a model, config, tokenizer or safetensors file fails."""
    def refuse(*args, **kwargs):
        raise AssertionError("something was read from disk")

    with contextlib.ExitStack() as stack:
        for target in ("transformers.AutoModelForCausalLM.from_pretrained",
                       "transformers.AutoConfig.from_pretrained",
                       "transformers.AutoTokenizer.from_pretrained",
                       "safetensors.torch.load_file", "safetensors.safe_open",
                       "safetensors.torch.safe_open"):
            stack.enter_context(mock.patch(target, side_effect=refuse))
        yield


def greedy_outputs(engine, prompts):
    outs = engine.generate([(i, p, GREEDY) for i, p in enumerate(prompts)])
    return [o.output_token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 9], 500, seed=11)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: tied embeddings
def test_second_models_weights_give_its_greedy_outputs(arch, arch_model, prompts):
    path = arch_model(arch)
    engine = make_engine(path)
    before = greedy_outputs(engine, prompts)
    second = other_model(path, seed=1)
    want = [hf_greedy(second, p, GREEDY["max_tokens"]) for p in prompts]
    assert want != before  # the test could fail: the two models disagree
    state = second.state_dict()
    with no_disk_reads():
        stats = engine.update_weights(state)
        assert greedy_outputs(engine, prompts) == want
    assert stats["num_tensors"] == len(state)
    assert stats["num_bytes"] == sum(t.numel() * t.element_size() for t in state.values())


def test_tied_embeddings_load_from_either_name_and_refuse_different_values(arch_model, prompts):
    path = arch_model("qwen3")
    engine = make_engine(path)
    assert engine.loaded.model.lm_head.weight is engine.loaded.model.model.embed_tokens.weight
    second = other_model(path, seed=2)
    state = {k: v for k, v in second.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(state)  # a checkpoint without lm_head.weight (tied)
    assert greedy_outputs(engine, prompts) == [hf_greedy(second, p, 10) for p in prompts]
    bad = dict(second.state_dict())
    bad["lm_head.weight"] = bad["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="tied to 'model.embed_tokens.weight'"):
        engine.update_weights(bad)


def test_sharded_checkpoint_streams_in_file_by_file(arch_model, prompts, tmp_path):
    from safetensors import safe_open

    path = arch_model("llama")
    engine = make_engine(path)
    second = other_model(path, seed=3)
    second.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(Path(tmp_path).glob("model-*.safetensors"))
    assert len(shards) > 2

    def read(shard):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    total = 0
    for shard in shards:  # one update per file: each is a subset of the names
        total += engine.update_weights(read(shard))["num_tensors"]
    assert total == len(second.state_dict())
    assert greedy_outputs(engine, prompts) == [hf_greedy(second, p, 10) for p in prompts]


def test_payload_round_trip_keeps_bf16_bits_and_casts_on_load(arch_model, prompts):
    path = arch_model("llama")
    second = other_model(path, seed=4)
    bf16 = {k: v.to(torch.bfloat16) for k, v in second.state_dict().items()}
    payload = pack_weights(bf16.items())
    assert isinstance(payload, WeightPayload) and payload.nbytes == sum(
        t.numel() * 2 for t in bf16.values())
    for name, tensor in payload.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, bf16[name])
    engine = make_engine(path)
    engine.update_weights(payload)  # bf16 into a float32 model: cast
    for name, tensor in engine.loaded.model.state_dict().items():
        assert torch.equal(tensor, bf16[name].float()), name


def test_bad_updates_fail_with_the_tensor_named_and_change_nothing(arch_model, prompts):
    path = arch_model("llama")
    engine = make_engine(path)
    before = greedy_outputs(engine, prompts)
    good = other_model(path, seed=5).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    cases = [
        ({**good, "model.layers.0.mlp.up_projj.weight": good[name]},
         ValueError, r"not in the model's state dict.*did you mean 'model.layers.0.mlp.up_proj"),
        ({**good, name: good[name][:, :10]}, ValueError, r"up_proj.weight'\]: shape"),
        ({**good, name: good[name].to(torch.int32)}, ValueError, r"up_proj.weight'\]: dtype"),
        ({**good, name: good[name].tolist()}, TypeError, r"up_proj.weight'\]: expected a tensor"),
    ]
    for weights, error, message in cases:
        with pytest.raises(error, match=message):
            engine.update_weights(weights)
    pairs = list(good.items()) + [(name, good[name])]
    with pytest.raises(ValueError, match="given twice"):
        engine.update_weights(WeightPayload(*zip(*[(n, "float32", t.numpy()) for n, t in pairs])))
    with pytest.raises(TypeError, match="weights: expected a state dict"):
        engine.update_weights("model.safetensors")
    assert greedy_outputs(engine, prompts) == before  # all-or-nothing for mappings


def test_update_resets_the_prefix_cache_and_waits_for_idle(arch_model, prompts):
    path = arch_model("llama")
    engine = make_engine(path)
    long_prompt = random_prompts([40], 500, seed=12)[0]
    greedy_outputs(engine, [long_prompt])
    cached = engine.stats.num_cached_prompt_tokens
    greedy_outputs(engine, [long_prompt])
    assert engine.stats.num_cached_prompt_tokens > cached  # the prefix cache works
    second = other_model(path, seed=6)
    engine.update_weights(second.state_dict())
    cached = engine.stats.num_cached_prompt_tokens
    assert greedy_outputs(engine, [long_prompt]) == [hf_greedy(second, long_prompt, 10)]
    assert engine.stats.num_cached_prompt_tokens == cached  # stale KV never reused
    engine.add_request("busy", prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.update_weights(second.state_dict())
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_update_reaches_the_captured_graphs(tiny_model_factory, prompts):
    """bf16 on CUDA (FlashInfer, CUDA graphs): after an update with B's weights, engine A
    gives exactly the outputs of an engine that loaded B (graph replays read the new weights
    in place)."""
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
    path_a = tiny_model_factory("qwen2", **shape)
    path_b = tiny_model_factory("qwen2", seed=1, **shape)
    options = dict(device="cuda", dtype="bfloat16")
    engine_b = make_engine(path_b, **options)
    want = greedy_outputs(engine_b, prompts)
    state = {k: v.to("cpu", torch.float32) for k, v in engine_b.loaded.model.state_dict().items()}
    del engine_b
    engine_a = make_engine(path_a, **options)
    assert greedy_outputs(engine_a, prompts) != want
    engine_a.update_weights(state)  # float32 host tensors: cast to bf16 on the copy
    assert greedy_outputs(engine_a, prompts) == want
