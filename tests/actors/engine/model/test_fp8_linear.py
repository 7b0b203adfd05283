"""The FP8 projection on CPU (torch's float8_e4m3fn and ``_scaled_mm`` emulate the GPU path):
its output against the dequantized matmul, the hand-off of a producer's quantization, the
fused layers that make it (TRITON_INTERPRET=1), and ``update_weights`` re-quantizing in place.
"""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine.model.quantization import fp8_model
from actors.engine.model.quantization.fp8_linear import (
    FP8_INPUT,
    Fp8Linear,
    attach_fp8_input,
)
from actors.engine.model.quantization.fp8_math import (
    dequantize_rows,
    quantize_rows_torch,
    quantize_weight_torch,
)
from actors.engine.model.quantization.fp8_model import quantize_decoder
from tests.actors.helpers import make_engine, random_prompts

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 0}


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 1)
    return linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 16, 16), (7, 64, 48), (33, 96, 160)])
def test_fp8_linear_equals_the_dequantized_matmul(rows, k, n, bias):
    linear = _linear(k, n, bias, seed=rows)
    layer = Fp8Linear.from_linear(linear)
    x = (torch.randn(1, rows, k) * 2).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (1, rows, n) and out.dtype == torch.bfloat16
    q, scale = quantize_rows_torch(x[0])
    want = dequantize_rows(q, scale) @ layer.dequantized_weight().t()
    if bias:
        want = want.to(torch.bfloat16).float() + linear.bias.float()
    # float32 accumulation in another order, then bf16 rounding (one or two roundings)
    torch.testing.assert_close(out[0].float(), want, rtol=2 ** -7, atol=2 ** -7 * float(
        want.abs().max()) * 0.01)
    # and FP8 is close to the bf16 layer it replaces (a few e4m3 steps of the operands)
    ref = linear(x).float()
    assert float((out.float() - ref).abs().max()) <= 0.1 * float(ref.abs().max())


def test_an_attached_quantization_is_used_instead_of_quantizing_again():
    layer = Fp8Linear.from_linear(_linear(64, 32, bias=True))
    x = torch.randn(3, 64).to(torch.bfloat16)
    plain = layer(x)
    q, scale = quantize_rows_torch(x)
    assert torch.equal(layer(attach_fp8_input(x.clone(), q, scale)), plain)
    zeros = attach_fp8_input(x.clone(), torch.zeros_like(q), scale)  # proves which is read
    assert torch.equal(layer(zeros), layer.bias.expand(3, 32))
    # a view or any new tensor made from the marked one carries no mark
    assert getattr(zeros.view(3, 64), FP8_INPUT, None) is None


def test_load_weight_requantizes_into_the_same_storage():
    layer = Fp8Linear.from_linear(_linear(64, 32, bias=False))
    ptr, scale_ptr = layer.weight.data_ptr(), layer.weight_scale.data_ptr()
    new = torch.randn(32, 64, dtype=torch.bfloat16) * torch.logspace(-3, 1, 32)[:, None]
    new[5] = 0
    layer.load_weight(new)
    q, scale = quantize_weight_torch(new)
    assert layer.weight.data_ptr() == ptr and layer.weight_scale.data_ptr() == scale_ptr
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale[0], scale)
    assert torch.isfinite(layer.dequantized_weight()).all()
    assert layer.dequantized_weight()[5].abs().sum() == 0


# ---------------------------------------------------------------------- fused layers
@pytest.fixture
def fp8_hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16,
                                                 attn_implementation="eager").eval()
    model.requires_grad_(False)
    quantize_decoder(model, model.model)
    return model


def test_fused_norms_hand_their_quantization_to_the_projections(fp8_hf_model):
    pytest.importorskip("triton")
    from actors.engine.model.fused_layers import fp8_fed_norms, install_fused_layers

    plain = copy.deepcopy(fp8_hf_model)
    fed = fp8_fed_norms(fp8_hf_model)
    layers = fp8_hf_model.model.layers
    assert fed == {id(m) for layer in layers
                   for m in (layer.input_layernorm, layer.post_attention_layernorm)}
    fused = install_fused_layers(fp8_hf_model)
    described = fused.describe()
    assert described["fp8_rms_norm"] == 2 * len(layers)  # the final norm feeds the bf16 head
    assert described["rms_norm"] == 2 * len(layers) + 1
    assert described["silu_mul"] == len(layers) and not described["kept"]
    x = torch.randn(1, 5, 64).to(torch.bfloat16)
    out = layers[0].input_layernorm(x)
    q, scale = getattr(out, FP8_INPUT)
    q_ref, scale_ref = quantize_rows_torch(out[0])
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    assert getattr(fp8_hf_model.model.norm(x), FP8_INPUT, None) is None
    # the fused model computes what the unfused FP8 model computes
    ids = torch.tensor([random_prompts([12], 500, seed=3)[0]])
    with torch.no_grad():
        got, want = fp8_hf_model(ids).logits.float(), plain(ids).logits.float()
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


# ---------------------------------------------------------------------- update_weights
@pytest.fixture
def emulate_fp8(monkeypatch):
    monkeypatch.setattr(fp8_model, "check_fp8_device", lambda device, dtype: None)


def _other_model(path: str, seed: int, out: str) -> dict[str, torch.Tensor]:
    """Writes the model at ``path`` with redrawn weights to ``out``; returns its bf16 state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fused", [False, True])  # fused: one GEMM for q/k/v, gate/up
def test_update_weights_requantizes_bf16_tensors_in_place(tiny_llama, tmp_path, emulate_fp8,
                                                          fused):
    options = {"device": "cpu", "dtype": "bfloat16", "quantization": "fp8",
               "fused_projections": fused}
    engine = make_engine(tiny_llama, **options)
    spec = engine.weights.spec()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert spec[name] == ((64, 64), "bfloat16")  # what a trainer sends
    assert spec["lm_head.weight"][1] == "bfloat16"
    layer = engine.weights.quantized[name]
    ptr = layer.weight.data_ptr()
    new = _other_model(tiny_llama, seed=5, out=str(tmp_path / "other"))
    stats = engine.update_weights(new)
    assert stats["num_tensors"] == len(new)
    assert layer.weight.data_ptr() == ptr
    q, scale = quantize_weight_torch(new[name])
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale[0], scale)
    # the updated engine computes what an FP8 engine built on the new checkpoint computes
    fresh = make_engine(str(tmp_path / "other"), **options)
    prompts = random_prompts([5, 17, 9], 500, seed=11)
    a = engine.generate([(i, p, GREEDY) for i, p in enumerate(prompts)])
    b = fresh.generate([(i, p, GREEDY) for i, p in enumerate(prompts)])
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert [o.prompt_logprobs for o in a] == [o.prompt_logprobs for o in b]
    with pytest.raises(ValueError, match=r"q_proj\.weight.*shape \(64, 32\)"):
        engine.update_weights({name: torch.zeros(64, 32, dtype=torch.bfloat16)})


@pytest.mark.parametrize("fused", [False, True])
def test_sleep_level_2_frees_the_fp8_weights_and_update_weights_refills_them(
        tiny_llama, emulate_fp8, fused):
    import safetensors.torch

    engine = make_engine(tiny_llama, device="cpu", dtype="bfloat16", quantization="fp8",
                         fused_projections=fused)
    prompts = random_prompts([6, 11], 500, seed=4)
    before = engine.generate([(i, p, GREEDY) for i, p in enumerate(prompts)])
    freed = engine.sleep(level=2)
    layer = engine.weights.quantized["model.layers.1.mlp.up_proj.weight"]
    assert layer.weight.numel() == 0 and freed["weights"] > 0
    engine.wake_up()
    assert "model.layers.1.mlp.up_proj.weight" in engine.weights.missing_names()
    stored = safetensors.torch.load_file(f"{tiny_llama}/model.safetensors")
    engine.update_weights({k: v.to(torch.bfloat16) for k, v in stored.items()})
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (128, 64)
    after = engine.generate([(i, p, GREEDY) for i, p in enumerate(prompts)])
    assert [o.output_token_ids for o in after] == [o.output_token_ids for o in before]
    assert [o.prompt_logprobs for o in after] == [o.prompt_logprobs for o in before]


def test_fused_fp8_projections_give_the_outputs_of_the_layers_alone(tiny_llama, emulate_fp8):
    prompts = random_prompts([6, 19, 9], 500, seed=8)
    outs = []
    for fused in (False, True):
        engine = make_engine(tiny_llama, device="cpu", dtype="bfloat16", quantization="fp8",
                             fused_projections=fused)
        outs.append(engine.generate([(i, p, GREEDY) for i, p in enumerate(prompts)]))
        engine.close()
    assert engine.info()["fused_projections"]["qkv"] == 2  # the second engine's, fused
    assert [o.output_token_ids for o in outs[0]] == [o.output_token_ids for o in outs[1]]
    assert [o.prompt_logprobs for o in outs[0]] == [o.prompt_logprobs for o in outs[1]]
