"""Fused q/k/v and gate/up GEMMs (``actors.engine.model.fused_projections``) on CPU fp32:
the same logits and greedy tokens as the model's own layers, the HF-named parameters views of
the fused storage (weight updates, sleep and wake-up), and the layouts it leaves alone."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.model.fused_projections import ProjectionGroup, install_fused_projections
from actors.engine.weights import WeightLoader
from tests.actors.engine.test_weights import greedy_outputs, no_disk_reads
from tests.actors.helpers import make_engine, random_prompts

VOCAB = 128


def _tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    torch.manual_seed(seed)
    cfg = cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB, head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _ids(n: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _greedy(model: torch.nn.Module, ids: torch.Tensor, n: int = 8) -> list[int]:
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, -n:].tolist()


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = ProjectionGroup.compute
    monkeypatch.setattr(ProjectionGroup, "compute",
                        lambda self, x: calls.append(len(self.layers)) or real(self, x))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_fused_model_gives_the_same_logits_and_greedy_tokens(arch, monkeypatch):
    model = _tiny(arch)
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    fused = install_fused_projections(model)
    assert fused.describe() == {"qkv": 2, "gate_up": 2, "kept": []}
    assert dict(model.named_parameters()) == params  # the same Parameter objects, names
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() \
        == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
    assert (attn.q_proj.bias is not None) == (arch == "qwen2")
    calls = _counting(monkeypatch)
    ids = _ids()
    ours, ref = _logits(model, ids), _logits(reference, ids)
    assert sorted(calls) == [2, 2, 3, 3]  # one GEMM per group and layer
    assert (ours - ref).abs().max() <= 1e-5
    assert _greedy(model, ids) == _greedy(reference, ids)


def test_with_the_fused_layers_the_views_go_through_their_kernels():
    """qwen3: q/k norms, rotary and SiLU-mul kernels read the strided columns of the fused
    GEMMs (TRITON_INTERPRET=1 on CPU) and give what they give on the separate layers' outputs."""
    pytest.importorskip("triton")
    import transformers

    from actors.engine.model.fused_layers import install_fused_layers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96,
                                   vocab_size=VOCAB, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    plain = copy.deepcopy(model)
    assert install_fused_projections(model).describe()["qkv"] == 2
    layers, plain_layers = install_fused_layers(model), install_fused_layers(plain)
    ids = _ids()
    with torch.no_grad(), layers.active():
        ours = model(ids).logits
    with torch.no_grad(), plain_layers.active():
        ref = plain(ids).logits
    assert torch.equal(ours, ref)


def test_a_model_without_the_layout_is_untouched():
    """gpt2 computes q/k/v in one Conv1D (``c_attn``) and its MLP has no gate: nothing fused,
    no parameter moved."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    ref = _logits(model, _ids())
    fused = install_fused_projections(model)
    assert fused.describe() == {"qkv": 0, "gate_up": 0, "kept": []}
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert torch.equal(_logits(model, _ids()), ref)


@pytest.mark.parametrize("model_type,qkv,gate_up", [
    ("gemma2", 2, 2), ("cohere", 2, 2), ("mixtral", 2, 0),  # mixtral: 3-D experts
    ("deepseek_v3", 0, 2),  # MLA: no q/k/v layers; the dense and shared-expert MLPs
    ("phi3", 0, 0), ("falcon", 0, 0),  # qkv_proj / query_key_value: fused already
    ("biogpt", 0, 0),  # its attention class may take k/v from another input
])
def test_architectures_stay_exact(model_type, qkv, gate_up):
    from transformers import AutoModelForCausalLM

    from tests.actors.engine.model.model_sweep import configs

    ids = torch.tensor([[5, 6, 7, 9, 11, 13, 17]])
    for config in configs(model_type):  # the first tiny config HF's forward runs
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
        try:
            ref = _logits(model, ids)
        except (RuntimeError, ValueError):
            continue
        break
    described = install_fused_projections(model).describe()
    assert (described["qkv"], described["gate_up"]) == (qkv, gate_up), described
    assert (_logits(model, ids) - ref).abs().max() <= 1e-5


class _CrossAttention(torch.nn.Module):
    """k/v read another input than q: the forward's source shows it, nothing is fused."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, hidden_states: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        return self.q_proj(hidden_states) + self.k_proj(states) * self.v_proj(states)


class _OwnLinear(torch.nn.Linear):
    pass


class _Mlp(torch.nn.Module):
    def __init__(self, layer: type = torch.nn.Linear, bias: tuple = (False, False)) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = layer(8, 6, bias=bias[0]), layer(8, 6, bias=bias[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)


@pytest.mark.parametrize("module,why", [
    (_CrossAttention(), "forward does not call them on one input"),
    (_Mlp(_OwnLinear), "not all nn.Linear or all Fp8Linear"),
    (_Mlp(bias=(True, False)), "biases on some layers only"),
])
def test_layouts_that_are_not_fused_keep_their_layers(module, why):
    before = {n: p.data_ptr() for n, p in module.named_parameters()}
    fused = install_fused_projections(torch.nn.Sequential(module))
    assert not fused.groups and len(fused.kept) == 1 and fused.kept[0].endswith(why)
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == before
    assert all("forward" not in m.__dict__ for m in module.modules())


def _fp8_mlp(seed: int = 0, bias: tuple = (True, True)) -> torch.nn.Module:
    from actors.engine.model.quantization.fp8_linear import Fp8Linear

    torch.manual_seed(seed)
    mlp = _Mlp(bias=bias).to(torch.bfloat16)
    mlp.gate_proj = Fp8Linear.from_linear(mlp.gate_proj)
    mlp.up_proj = Fp8Linear.from_linear(mlp.up_proj)
    return mlp


def _scaled_mms(monkeypatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm",
                        lambda a, b, **kw: calls.append(tuple(b.shape)) or real(a, b, **kw))
    return calls


def test_fp8_projections_run_one_scaled_mm_with_their_scales_side_by_side(monkeypatch):
    mlp, own = _fp8_mlp(), _fp8_mlp()
    fused = install_fused_projections(torch.nn.Sequential(mlp))
    assert len(fused.groups) == 1 and not fused.kept
    gate, up = mlp.gate_proj, mlp.up_proj
    for attr in ("weight", "weight_scale", "bias"):  # views of one storage each
        assert getattr(gate, attr).untyped_storage().data_ptr() == \
            getattr(up, attr).untyped_storage().data_ptr()
    calls = _scaled_mms(monkeypatch)
    x = torch.randn(5, 8).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(mlp(x), own(x))
        assert calls == [(8, 12)] + [(8, 6)] * 2  # one GEMM for both; each of own's
        # an input quantized by its producer is taken as is
        from actors.engine.model.quantization.fp8_linear import attach_fp8_input
        from actors.engine.model.quantization.fp8_math import quantize_rows_torch

        y = torch.randn(4, 8).to(torch.bfloat16)
        q, scale = quantize_rows_torch(y * 2)
        want = own.gate_proj(attach_fp8_input(y.clone(), q, scale))
        assert torch.equal(gate(attach_fp8_input(y, q, scale)), want)
        # bf16 weights re-quantized in place reach the fused GEMM
        w = torch.randn(6, 8).to(torch.bfloat16) * 3
        for m in (mlp, own):
            m.up_proj.load_weight(w)
        calls.clear()
        assert torch.equal(mlp(x), own(x)) and calls[0] == (8, 12)
        assert torch.equal(up.weight_scale, own.up_proj.weight_scale)


def test_fp8_and_plain_layers_are_not_fused_together():
    from actors.engine.model.quantization.fp8_linear import Fp8Linear

    module = _Mlp()
    module.gate_proj = Fp8Linear.from_linear(module.gate_proj)
    fused = install_fused_projections(torch.nn.Sequential(module))
    assert not fused.groups and fused.kept[0].endswith("not all nn.Linear or all Fp8Linear")


def test_each_call_gets_its_own_inputs_projection():
    """The cached GEMM serves only the same tensor object, unchanged: another input, an
    in-place write or a changed storage runs the layers' own GEMM math again."""
    mlp = _Mlp(bias=(True, True))
    install_fused_projections(torch.nn.Sequential(mlp))
    x, y = torch.randn(3, 8), torch.randn(3, 8)

    def own(layer, t):
        return torch.nn.functional.linear(t, layer.weight, layer.bias)

    with torch.no_grad():
        gate = mlp.gate_proj(x)
        assert torch.allclose(mlp.up_proj(y), own(mlp.up_proj, y))  # another input
        assert torch.allclose(gate, own(mlp.gate_proj, x))
        mlp.gate_proj(x)
        x.mul_(2)  # in place between the two calls
        assert torch.allclose(mlp.up_proj(x), own(mlp.up_proj, x))
        mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone() + 1  # out of the storage
        assert torch.allclose(mlp.gate_proj(x), own(mlp.gate_proj, x))
        assert torch.allclose(mlp.up_proj(x), own(mlp.up_proj, x))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weight_updates_reach_the_fused_gemm(arch):
    """A state dict copied in by HF name gives the logits of a fresh model of those weights,
    and the fused storage is written in place."""
    model = _tiny(arch)
    install_fused_projections(model)
    attn = model.model.layers[1].self_attn
    pointer = attn.q_proj.weight.untyped_storage().data_ptr()
    second = _tiny(arch, seed=5)
    WeightLoader(model).load(second.state_dict())
    assert attn.q_proj.weight.untyped_storage().data_ptr() == pointer
    ids = _ids()
    assert (_logits(model, ids) - _logits(second, ids)).abs().max() <= 1e-5
    one = {"model.layers.1.self_attn.v_proj.weight": torch.zeros_like(attn.v_proj.weight),
           "model.layers.0.mlp.gate_proj.weight": torch.zeros_like(
               model.model.layers[0].mlp.gate_proj.weight)}
    WeightLoader(model).load(one)
    second.load_state_dict(one, strict=False)
    assert (_logits(model, ids) - _logits(second, ids)).abs().max() <= 1e-5


def test_discard_and_restore_give_the_views_one_storage_again(monkeypatch):
    model = _tiny("qwen2")
    install_fused_projections(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids()
    before = _logits(model, ids)
    loader = WeightLoader(model)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert loader.discard() == size
    assert all(p.numel() == 0 for p in model.parameters())
    loader.restore()
    mlp = model.model.layers[0].mlp
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == \
        mlp.gate_proj.weight.untyped_storage().data_ptr()
    assert mlp.gate_proj.weight.untyped_storage().nbytes() == 2 * mlp.gate_proj.weight.nbytes
    loader.load(state)
    calls = _counting(monkeypatch)
    assert torch.equal(_logits(model, ids), before)
    assert len(calls) == 4  # still one GEMM per group


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([21, 6, 13], 500, seed=3)


def test_engine_with_fused_projections_sleeps_and_takes_weights(tiny_model_factory, prompts):
    path = tiny_model_factory("qwen2")
    plain = make_engine(path)
    assert plain.info()["fused_projections"] is None  # off by default on CPU
    engine = make_engine(path, fused_projections=True)
    assert engine.info()["fused_projections"]["qkv"] == engine.loaded.num_layers
    before = greedy_outputs(engine, prompts)
    assert before == greedy_outputs(plain, prompts)
    state = {k: v.clone() for k, v in engine.loaded.model.state_dict().items()}
    engine.sleep(1)
    engine.wake_up()
    assert greedy_outputs(engine, prompts) == before
    engine.sleep(2)
    with no_disk_reads():
        engine.wake_up()
        engine.update_weights(state)
        assert greedy_outputs(engine, prompts) == before
    mlp = engine.loaded.model.model.layers[0].mlp  # the fused GEMM runs again after waking
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == \
        mlp.gate_proj.weight.untyped_storage().data_ptr()
    scaled = {k: v * 1.1 for k, v in state.items()}
    engine.update_weights(scaled)
    plain.update_weights(scaled)
    after = greedy_outputs(engine, prompts)
    assert after != before and after == greedy_outputs(plain, prompts)


def test_engine_option():
    from actors.engine.builder import resolve_fused_projections

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="engine.fused_projections"):
        EngineConfig(fused_projections="yes")
    assert resolve_fused_projections(EngineConfig(device="cpu"), cpu) is False
    assert resolve_fused_projections(EngineConfig(device="cpu", fused_projections=True), cpu)
    assert resolve_fused_projections(EngineConfig(device="cpu"), cuda)
    assert not resolve_fused_projections(EngineConfig(device="cpu", fused_projections=False),
                                         cuda)
