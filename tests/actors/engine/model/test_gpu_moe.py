"""The fused MoE kernels on a CUDA GPU in bf16 at real model shapes, under CUDA graphs, and in
the engine (run with ``pytest -m gpu tests/actors/engine/model/test_gpu_moe.py``).

Tolerances: the kernels round where the torch ops round, so against their torch oracle only the
float32 sum order of the GEMMs differs (a last-bit flip of a bf16 intermediate now and then):
relative error (Frobenius) below one bf16 epsilon."""

from __future__ import annotations

import pytest
import torch

from tests.actors.engine.test_gpu_engine import assert_paths_agree
from tests.actors.helpers import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _case(tokens, top_k, experts, hidden, inter, transposed=False, bias=False, seed=0,
          dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    x = rand(tokens, hidden)
    ids = torch.rand(tokens, experts, generator=gen, device="cuda").topk(top_k, -1)[1]
    weights = torch.rand(tokens, top_k, generator=gen, device="cuda").softmax(-1).to(dtype)
    scale = hidden ** -0.5
    if transposed:
        gate_up, down = rand(experts, hidden, 2 * inter, scale=scale), rand(experts, inter,
                                                                             hidden, scale=scale)
    else:
        gate_up, down = rand(experts, 2 * inter, hidden, scale=scale), rand(experts, hidden,
                                                                             inter, scale=scale)
    biases = (rand(experts, 2 * inter, scale=0.1), rand(experts, hidden, scale=0.1)) \
        if bias else (None, None)
    return x, ids, weights, gate_up, down, biases


@pytest.mark.parametrize("tokens", [1, 7, 64, 512, 1024, 4096])
def test_qwen3_30b_a3b_experts_equal_the_oracle(tokens):
    from actors.engine.model.kernels.moe_gemm import (
        ExpertLayout,
        fused_experts,
        fused_experts_torch,
    )

    x, ids, w, gate_up, down, _ = _case(tokens, 8, 128, 2048, 768)
    layout = ExpertLayout()
    got = fused_experts(x, ids, w, gate_up, down, layout)
    want = fused_experts_torch(x, ids, w, gate_up, down, layout)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _relative(got, want) < BF16_EPS


@pytest.mark.parametrize("swap,tma", [(True, False), (True, True)], ids=["swap", "swap-tma"])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_swapped_tiles_equal_the_oracle(swap, tma, block_m):
    from actors.engine.model.kernels.moe_gemm import (
        ExpertLayout,
        fused_experts,
        fused_experts_torch,
    )
    from actors.engine.model.kernels.moe_tiles import TileConfig

    config = TileConfig(block_m, 8, (128, 64, 4, 4), (128, 128, 4, 3), swap, tma)
    for tokens in (7, 512, 1024):
        x, ids, w, gate_up, down, _ = _case(tokens, 8, 128, 2048, 768, seed=tokens)
        got = fused_experts(x, ids, w, gate_up, down, ExpertLayout(), config=config)
        want = fused_experts_torch(x, ids, w, gate_up, down, ExpertLayout())
        assert _relative(got, want) < BF16_EPS
    x, ids, w, gate_up, down, biases = _case(64, 4, 32, 576, 640, transposed=True, bias=True)
    oai = ExpertLayout(transposed=True, interleaved=True, activation="swiglu_oai")
    assert _relative(fused_experts(x, ids, w, gate_up, down, oai, *biases, config=config),
                     fused_experts_torch(x, ids, w, gate_up, down, oai, *biases)) < BF16_EPS


@pytest.mark.parametrize("tokens", [3, 256])
def test_gpt_oss_and_mixtral_layouts_equal_the_oracle(tokens):
    from actors.engine.model.kernels.moe_gemm import (
        ExpertLayout,
        fused_experts,
        fused_experts_torch,
    )

    x, ids, w, gate_up, down, biases = _case(tokens, 4, 32, 576, 640, transposed=True,
                                             bias=True)
    oai = ExpertLayout(transposed=True, interleaved=True, activation="swiglu_oai")
    assert _relative(fused_experts(x, ids, w, gate_up, down, oai, *biases),
                     fused_experts_torch(x, ids, w, gate_up, down, oai, *biases)) < BF16_EPS
    x, ids, w, gate_up, down, _ = _case(tokens, 2, 8, 1024, 1792)
    assert _relative(fused_experts(x, ids, w, gate_up, down, ExpertLayout()),
                     fused_experts_torch(x, ids, w, gate_up, down, ExpertLayout())) < BF16_EPS


def test_float32_experts_use_exact_products():
    from actors.engine.model.kernels.moe_gemm import (
        ExpertLayout,
        fused_experts,
        fused_experts_torch,
    )

    x, ids, w, gate_up, down, _ = _case(100, 4, 16, 256, 192, dtype=torch.float32)
    got = fused_experts(x, ids, w, gate_up, down, ExpertLayout())
    want = fused_experts_torch(x, ids, w, gate_up, down, ExpertLayout())
    assert _relative(got, want) < 1e-5  # no TF32


@pytest.mark.parametrize("pairs,experts,block_m", [(4096, 128, 64), (131072, 128, 64),
                                                   (8, 128, 16), (2048, 8, 64)])
def test_align_equals_the_oracle(pairs, experts, block_m):
    from actors.engine.model.kernels.moe_align import moe_align, moe_align_torch

    ids = torch.randint(0, experts, (pairs, 1), device="cuda")
    got_pairs, got_blocks = moe_align(ids, experts, block_m)
    want_pairs, want_blocks = moe_align_torch(ids, experts, block_m)
    assert torch.equal(got_blocks, want_blocks)
    used = int((want_blocks >= 0).sum()) * block_m
    assert torch.equal(got_pairs[:used], want_pairs[:used])


def test_routing_equals_the_oracle_on_bf16_logits():
    from actors.engine.model.kernels.moe_routing import RoutingSpec, route, route_torch

    logits = torch.randn(512, 128, device="cuda").bfloat16()
    for spec in (RoutingSpec(8, renormalize=True), RoutingSpec(4, choose_on_logits=True),
                 RoutingSpec(8, scoring="sigmoid", has_bias=True, renormalize=True,
                             renorm_eps=1e-20, scale=2.5)):
        bias = torch.randn(128, device="cuda") * 0.01
        weights, ids = route(logits, spec, bias)
        want_w, want_ids = route_torch(logits, spec, bias)
        torch.testing.assert_close(weights.sort(-1)[0], want_w.sort(-1)[0], rtol=1e-5,
                                   atol=1e-6)
        same = (ids.sort(-1)[0] == want_ids.sort(-1)[0]).all(-1).float().mean()
        assert same > 0.98  # bf16 logits tie now and then; the tie may go either way


def test_the_fused_experts_replay_in_a_cuda_graph():
    from actors.engine.model.kernels.moe_gemm import ExpertLayout, fused_experts

    x, ids, w, gate_up, down, _ = _case(512, 8, 128, 2048, 768)
    layout = ExpertLayout()
    fused_experts(x, ids, w, gate_up, down, layout)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, ids, w, gate_up, down, layout)
    x2, ids2, w2, *_ = _case(512, 8, 128, 2048, 768, seed=1)
    x.copy_(x2)
    ids.copy_(ids2)
    w.copy_(w2)
    graph.replay()
    torch.testing.assert_close(out, fused_experts(x, ids, w, gate_up, down, layout), rtol=0,
                               atol=0)


def test_engine_uses_the_fused_path_by_default_with_outputs_as_without(tiny_model_factory):
    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    path = tiny_model_factory("qwen3_moe", hidden_size=256, intermediate_size=512,
                              moe_intermediate_size=128, head_dim=64)
    prompts = random_prompts([5 + 9 * i for i in range(16)], 400, seed=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=0)
    results = {}
    for fused in (True, False):
        engine = Engine(path, {"max_num_seqs": 16, "max_num_batched_tokens": 2048,
                               "max_model_len": 512, "num_kv_blocks": 1024,
                               "fused_moe": None if fused else False})
        info = engine.info()["fused_moe"]
        if fused:
            assert info["backend"] == "triton" and info["experts"] == info["routers"] == 2
            assert not info["kept"]
        else:
            assert info is None
        outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
        results[fused] = [(o.output_token_ids, o.logprobs) for o in outs]
        del engine
    assert_paths_agree(results, "fused MoE vs HF modules")
