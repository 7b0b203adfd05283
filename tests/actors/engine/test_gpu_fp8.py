"""``quantization: fp8`` on a CUDA GPU of compute capability >= 8.9 (FlashInfer attention,
CUDA-graph decode, the fused FP8 norm / SiLU kernels).

Run with ``pytest -m gpu tests/actors/engine/test_gpu_fp8.py`` on a Hopper machine. Reference:
the HF model (eager attention, bf16) with the same ``Fp8Linear`` layers (each quantizing its own
input with the standalone kernel): the engine's logits must be as close to it as the bf16
engine's are to HF's bf16 forward (twice that error, as test_gpu_engine.py allows).
"""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine
from actors.engine.model.quantization.fp8_math import quantize_weight_torch
from actors.engine.model.quantization.fp8_model import quantize_decoder
from sampler import SamplingParams
from tests.actors.helpers import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU of compute capability >= 8.9"),
]

GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
OPTIONS = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 512,
           "num_kv_blocks": 1024}


@pytest.fixture(scope="module")
def gpu_model(tiny_model_factory):
    return tiny_model_factory("qwen2", **GPU_SHAPE)


def _hf(path: str, fp8: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation="eager").cuda().eval()
    model.requires_grad_(False)
    if fp8:
        quantize_decoder(model, model.model)
    return model


def _prompt_logprobs(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    return [torch.tensor(o.prompt_logprobs[1:]) for o in outs]


def _hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(1, ids[0, 1:, None])[:, 0].cpu()


def test_the_fp8_engine_runs_fused_and_graphed_and_matches_its_reference(gpu_model):
    fp8 = Engine(gpu_model, {**OPTIONS, "quantization": "fp8"})
    info = fp8.info()
    assert info["quantization"]["fp8_layers"] == 7 * fp8.loaded.num_layers
    assert info["fused_layers"]["fp8_rms_norm"] == 2 * fp8.loaded.num_layers
    assert info["cuda_graphs"] and info["attention_backend"] == "flashinfer"
    prompts = random_prompts([3, 9, 21, 80, 14, 130], fp8.loaded.vocab_size, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    outs = fp8.generate([(i, p, params) for i, p in enumerate(prompts)])
    assert fp8.executor.runner.graphs.num_replays > 0
    full = [prompts[o.id] + list(o.output_token_ids) for o in outs]
    ours = _prompt_logprobs(fp8, full)
    bf16 = Engine(gpu_model, OPTIONS)
    base = _prompt_logprobs(bf16, full)
    ref8, ref16 = _hf(gpu_model, fp8=True), _hf(gpu_model, fp8=False)
    err8 = max(float((a - _hf_logprobs(ref8, s)).abs().max()) for a, s in zip(ours, full))
    err16 = max(float((b - _hf_logprobs(ref16, s)).abs().max()) for b, s in zip(base, full))
    drift = torch.cat([a - b for a, b in zip(ours, base)]).abs()
    print(f"fp8 engine vs HF fp8 {err8:.3g}, bf16 engine vs HF bf16 {err16:.3g}, "
          f"fp8 vs bf16 mean {drift.mean():.3g} max {drift.max():.3g}")
    assert err8 <= 2 * err16 + 0.05


def test_update_weights_requantizes_on_the_gpu(gpu_model, tiny_model_factory):
    import safetensors.torch

    other = tiny_model_factory("qwen2", **GPU_SHAPE, seed=3)
    engine = Engine(gpu_model, {**OPTIONS, "quantization": "fp8"})
    fresh = Engine(other, {**OPTIONS, "quantization": "fp8"})
    new = {k: v.to(torch.bfloat16) for k, v in
           safetensors.torch.load_file(f"{other}/model.safetensors").items()}
    name = "model.layers.1.mlp.down_proj.weight"
    layer = engine.weights.quantized[name]
    ptr = layer.weight.data_ptr()
    engine.update_weights(new)
    q, scale = quantize_weight_torch(new[name].cuda())
    assert layer.weight.data_ptr() == ptr
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale[0], scale)
    prompts = random_prompts([7, 33, 12], engine.loaded.vocab_size, seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    a = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    b = fresh.generate([(i, p, params) for i, p in enumerate(prompts)])
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
