"""Sharding of HF modules by ``base_model_tp_plan``, checked module by module in one process
(no process group): concatenated colwise outputs and summed rowwise outputs of the ranks'
shards equal the full module's output."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.model.lm_head import ModelHead
from actors.engine.model.loader import UnsupportedModelError, load_model
from actors.engine.parallel.sharding import shard_model


def _fake_comm(rank: int, world_size: int) -> SimpleNamespace:
    # the rowwise hook's all-reduce leaves each rank's partial sum (summed by the test), the
    # LM head's all-gather each rank's logits (put side by side by the test)
    return SimpleNamespace(rank=rank, world_size=world_size, enabled=True,
                           all_reduce=lambda t: t, all_gather=lambda t: [t])


def _shards(path: str, tp: int):
    loaded = load_model(path, EngineConfig(device="cpu", dtype="float32"))
    full = copy.deepcopy(loaded.model)
    ranks = []
    for rank in range(tp):
        mine = copy.copy(loaded)
        mine.model = copy.deepcopy(full)
        mine.head = ModelHead(mine.model)
        ranks.append(shard_model(mine, _fake_comm(rank, tp)))
    return full, ranks


@pytest.mark.parametrize("arch,tp,bias", [("qwen2", 2, False), ("llama", 4, False),
                                          ("llama", 2, True)])
def test_shards_recombine_to_the_full_modules(arch_model, tiny_model_factory, arch, tp, bias):
    # bias: every projection has one, so the rowwise o/down biases must be added once
    path = tiny_model_factory(arch, attention_bias=True, mlp_bias=True) if bias \
        else arch_model(arch)
    full, ranks = _shards(path, tp)
    modules = dict(full.named_modules())
    x = torch.randn(3, full.config.hidden_size)
    attn = modules["model.layers.0.self_attn"]
    kv_heads, head_dim = full.config.num_key_value_heads, attn.head_dim
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        key = f"model.layers.1.self_attn.{name}"
        mods = [dict(shard.model.named_modules())[key] for shard, _ in ranks]
        whole = modules[key]
        if name == "o_proj":
            inp = torch.randn(3, whole.in_features)
            step = whole.in_features // tp
            parts = [m(inp[:, r * step:(r + 1) * step]) for r, m in enumerate(mods)]
            torch.testing.assert_close(sum(parts), whole(inp), rtol=1e-5, atol=1e-5)
            continue
        out = whole(x)
        if name != "q_proj" and kv_heads < tp:  # replicated: rank r has KV head r*kv//tp
            for r, m in enumerate(mods):
                h = r * kv_heads // tp
                torch.testing.assert_close(m(x), out[:, h * head_dim:(h + 1) * head_dim])
        else:
            torch.testing.assert_close(torch.cat([m(x) for m in mods], dim=1), out)
    key = "model.layers.0.mlp"
    mlps = [dict(shard.model.named_modules())[key] for shard, _ in ranks]
    torch.testing.assert_close(sum(m(x) for m in mlps), modules[key](x), rtol=1e-5,
                               atol=1e-5)
    if bias:
        assert modules["model.layers.0.mlp.down_proj"].bias is not None
        assert not ranks[1][0].model.model.layers[0].self_attn.o_proj.bias.any()
    loaded, slices = ranks[-1]
    assert loaded.num_heads == full.config.num_attention_heads // tp
    assert loaded.num_kv_heads == max(1, kv_heads // tp)
    name = "model.layers.0.mlp.down_proj.weight"
    assert slices[name].full_shape == tuple(modules["model.layers.0.mlp.down_proj"]
                                            .weight.shape)


def test_a_model_without_a_plan_is_refused(tiny_llama):
    loaded = load_model(tiny_llama, EngineConfig(device="cpu", dtype="float32"))
    loaded.model.config.base_model_tp_plan = None
    with pytest.raises(UnsupportedModelError, match="base_model_tp_plan"):
        shard_model(loaded, _fake_comm(0, 2))
