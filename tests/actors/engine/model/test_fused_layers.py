"""The engine's fused Triton layers (``actors.engine.model.kernels``, ``actors.engine.model.fused_layers``) against their
torch oracles and the transformers code they replace (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from actors.engine.engine_config import EngineConfig  # noqa: E402
from actors.engine.model.fused_layers import install_fused_layers  # noqa: E402
from actors.engine.model.kernels.rms_norm import (  # noqa: E402
    rms_norm,
    rms_norm_torch,
    rows_per_program,
)
from actors.engine.model.kernels.rotary import apply_rotary, apply_rotary_torch  # noqa: E402
from actors.engine.model.kernels.silu_mul import silu_mul, silu_mul_torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's epsilon times the largest |b|."""
    scale = float(b.float().abs().max()) or 1.0
    return float((a.float() - b.float()).abs().max()) / (torch.finfo(b.dtype).eps * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 896)])
def test_rms_norm_equals_torch(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(DEVICE, dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    ours, ref = rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    # the float32 sum of squares and rsqrt may round differently (order, implementation)
    assert _ulps(ours, ref) <= 2.0
    if dtype != torch.float32:
        assert (ours != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(37, 128), (70, 64), (9, 200)])
def test_rms_norm_of_many_narrow_rows(dtype, rows, hidden):
    """Narrow rows (per-head q/k norms) share a program: several programs, the last one
    partly filled, each row normalised alone."""
    per = rows_per_program(hidden)
    assert per > 1 and rows > per and rows % per
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(DEVICE, dtype)
    x[3] *= 1e3  # a row far larger than its neighbours: their scales stay their own
    w = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    ours, ref = rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
    assert ours.shape == ref.shape
    for r in range(rows):
        assert _ulps(ours[r], ref[r]) <= 2.0, r
    heads = x.reshape(rows, 1, hidden).expand(rows, 3, hidden)  # a strided 3-D view
    assert torch.equal(rms_norm(heads, w, 1e-6), ours[:, None].expand(rows, 3, hidden))


def test_rms_norm_of_a_strided_and_a_3d_input_and_a_float32_weight():
    x = torch.randn(4, 5, 200, device=DEVICE, dtype=torch.bfloat16)[:, :, :96]
    w32 = torch.rand(96, device=DEVICE) + 0.5  # bf16 input, fp32 weight -> fp32 out
    ours, ref = rms_norm(x, w32, 1e-5), rms_norm_torch(x, w32, 1e-5)
    assert ours.dtype == ref.dtype == torch.float32 and ours.shape == (4, 5, 96)
    assert _ulps(ours, ref) <= 2.0
    assert rms_norm(x[:0], w32, 1e-5).shape == (0, 5, 96)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 200), (3, 4864)])
def test_silu_mul_equals_torch(dtype, shape):
    gen = torch.Generator().manual_seed(shape[1])
    gate = (torch.randn(*shape, generator=gen) * 4).to(DEVICE, dtype)
    up = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    ours, ref = silu_mul(gate, up), silu_mul_torch(gate, up)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert _ulps(ours, ref) <= 2.0  # exp in another implementation, then rounded


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reads_the_halves_of_one_gate_up_output_in_place(dtype):
    gen = torch.Generator().manual_seed(3)
    both = (torch.randn(1, 7, 2 * 2500, generator=gen) * 4).to(DEVICE, dtype)
    gate, up = both.split(2500, -1)  # [1, 7, 2500] views, rows 5000 apart
    ours = silu_mul(gate, up)
    assert ours.shape == gate.shape and ours.is_contiguous()
    assert torch.equal(ours, silu_mul(gate.contiguous(), up.contiguous()))
    assert _ulps(ours, silu_mul_torch(gate, up)) <= 2.0
    assert silu_mul(gate[:, :0], up[:, :0]).shape == (1, 0, 2500)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 1, 1, 8), (9, 7, 2, 64), (5, 32, 8, 128)])
def test_rotary_is_bit_identical_to_torch(dtype, tokens, hq, hk, dim):
    gen = torch.Generator().manual_seed(tokens * hq + dim)
    # [1, heads, T, D] views of packed [1, T, heads, D] projections, as transformers has them
    q = torch.randn(1, tokens, hq, dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(1, tokens, hk, dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    angle = torch.rand(1, tokens, dim // 2, generator=gen).to(DEVICE) * 100
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype)
    (qo, ko), (qr, kr) = apply_rotary(q, k, cos, sin), apply_rotary_torch(q, k, cos, sin)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()  # layout kept


def _tiny(arch: str, dtype=torch.bfloat16) -> torch.nn.Module:
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "qwen3": transformers.Qwen3Config, "gemma": transformers.GemmaConfig}[arch]
    torch.manual_seed(0)
    cfg = cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, vocab_size=128, head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(DEVICE).eval()


@pytest.mark.parametrize("arch,norms", [("qwen2", 5), ("llama", 5), ("qwen3", 9)])
def test_installed_model_gives_the_same_logits(arch, norms, monkeypatch):
    import actors.engine.model.kernels.rotary as rotary

    model = _tiny(arch)
    reference = copy.deepcopy(model)
    calls = []
    real = rotary.apply_rotary
    monkeypatch.setattr(rotary, "apply_rotary", lambda *a: calls.append(1) or real(*a))
    fused = install_fused_layers(model)
    assert fused.describe()["rms_norm"] == norms and fused.describe()["silu_mul"] == 2
    assert len(fused.describe()["rotary"]) == 1 and not fused.describe()["kept"]
    ids = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    calls.clear()
    with torch.no_grad(), fused.active():
        ours = model(ids).logits
    assert len(calls) == 2  # the rotary kernel ran in both layers
    with torch.no_grad():
        ref = reference(ids).logits
        calls.clear()
        outside = model(ids).logits  # outside active(): transformers' rotary function
    assert not calls
    assert _ulps(ours, ref) <= 2.0 and _ulps(outside, ref) <= 2.0


def test_a_norm_with_another_formula_keeps_its_own_code():
    """Gemma's RMSNorm scales by (1 + weight): the check at install time sees the difference
    and leaves the class alone (its rotary embedding is the Llama one and is fused)."""
    model = _tiny("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    reference = copy.deepcopy(model)
    fused = install_fused_layers(model)
    assert fused.describe()["rms_norm"] == 0 and "GemmaRMSNorm" in fused.describe()["kept"]
    assert fused.describe()["rotary"] == ["transformers.models.gemma.modeling_gemma"]
    ids = torch.arange(9, device=DEVICE)[None]
    with torch.no_grad(), fused.active():
        ours = model(ids).logits
    with torch.no_grad():
        assert _ulps(ours, reference(ids).logits) <= 2.0


def test_a_rotary_function_of_another_layout_keeps_its_own_code():
    """gpt-oss rotates with half-width cos / sin: the check's call of its function fails on
    the full-width layout, so the model keeps its own rotary code (and stays exact)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=32, vocab_size=128,
                                    head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to(DEVICE).eval()
    reference = copy.deepcopy(model)
    fused = install_fused_layers(model)
    home = "transformers.models.gpt_oss.modeling_gpt_oss"
    assert fused.describe()["rotary"] == [] and f"{home}.apply_rotary_pos_emb" in \
        fused.describe()["kept"]
    ids = torch.arange(9, device=DEVICE)[None]
    with torch.no_grad(), fused.active():
        ours = model(ids).logits
    with torch.no_grad():
        assert _ulps(ours, reference(ids).logits) <= 2.0


def test_active_restores_the_modeling_function_after_an_error():
    model = _tiny("qwen2")
    fused = install_fused_layers(model)
    home, original, _ = next(iter(fused.rotary.values()))
    with pytest.raises(RuntimeError, match="boom"), fused.active():
        assert home.apply_rotary_pos_emb is not original
        raise RuntimeError("boom")
    assert home.apply_rotary_pos_emb is original


def test_engine_option():
    with pytest.raises(ValueError, match="engine.fused_layers"):
        EngineConfig(fused_layers="yes")
    if DEVICE.type == "cpu":
        from actors.engine.builder import resolve_fused_layers

        assert resolve_fused_layers(EngineConfig(device="cpu"), DEVICE) is False
        with pytest.raises(ValueError, match="engine.fused_layers: .* CUDA"):
            resolve_fused_layers(EngineConfig(device="cpu", fused_layers=True), DEVICE)
