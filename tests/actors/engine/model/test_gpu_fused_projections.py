"""Fused q/k/v and gate/up GEMMs on a CUDA GPU in bf16: the model's logits against its own
layers', and the engine (FlashInfer, CUDA-graph decode, fused layers) with and without them.

Run with ``pytest -m gpu tests/actors`` on a CUDA machine. Tolerances (bf16): the fused model's
error against its float32 forward (max |logits - fp32| over the largest |fp32 logit|) stays
within twice the plain bf16 model's error plus 1e-3 (a wider GEMM may tile its reduction
otherwise); the engine's 16 greedy outputs agree as ``assert_paths_agree`` asks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.actors.engine.test_gpu_engine import assert_paths_agree
from tests.actors.helpers import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2)  # head_dim 64: FlashInfer and CUDA graphs


def _error(logits: torch.Tensor, exact: torch.Tensor) -> float:
    return float((logits.float() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_logits_are_close_to_the_plain_layers_in_bf16(arch):
    import transformers

    from actors.engine.model.fused_projections import install_fused_projections

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    torch.manual_seed(0)
    cfg = cls(num_hidden_layers=2, vocab_size=512, head_dim=64, **SHAPE)
    exact = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    exact = exact.cuda().eval()
    plain = copy.deepcopy(exact).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    assert install_fused_projections(fused).describe() == {"qkv": 2, "gate_up": 2, "kept": []}
    for n in (1, 7, 200):
        ids = torch.randint(0, 512, (1, n), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(n))
        with torch.no_grad():
            ref = exact(ids).logits.float()
            plain_err, fused_err = _error(plain(ids).logits, ref), _error(fused(ids).logits, ref)
        assert fused_err <= 2 * plain_err + 1e-3, (n, fused_err, plain_err)


def test_engine_fuses_by_default_and_sleeps_with_its_graphs(tiny_model_factory):
    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    path = tiny_model_factory("qwen2", **SHAPE)
    prompts = random_prompts([5 + 9 * i for i in range(16)], 400, seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=0)
    requests = [(i, p, params) for i, p in enumerate(prompts)]
    results = {}
    for fused in (True, False):
        engine = Engine(path, {"max_num_seqs": 16, "max_num_batched_tokens": 2048,
                               "max_model_len": 512, "num_kv_blocks": 1024,
                               "fused_projections": None if fused else False})
        info = engine.info()["fused_projections"]
        if fused:
            assert info == {"qkv": engine.loaded.num_layers,
                            "gate_up": engine.loaded.num_layers, "kept": []}
        else:
            assert info is None
        outs = engine.generate(requests)
        results[fused] = [(o.output_token_ids, o.logprobs) for o in outs]
        if fused:  # the graphs captured again after a level-2 sleep read the new storage
            graphs = engine.info()["cuda_graphs"]
            state = {k: v.clone() for k, v in engine.loaded.model.state_dict().items()}
            engine.sleep(2)
            engine.wake_up()
            engine.update_weights(state)
            again = engine.generate(requests)
            assert engine.info()["cuda_graphs"] == graphs
            assert [o.output_token_ids for o in again] == [t for t, _ in results[True]]
        del engine
    assert_paths_agree(results, "fused projections vs HF modules")
