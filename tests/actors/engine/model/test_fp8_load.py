"""``quantization: fp8`` on CPU: the option, the refusals before loading, the quantization of a
bf16 checkpoint at load and the FP8 checkpoints read directly.

The engine refuses FP8 off a CUDA GPU of compute capability >= 8.9; these tests take that
check out (``emulate_fp8``) to run the load path on CPU, where torch has float8_e4m3fn tensors
and ``torch._scaled_mm`` (the emulation the GPU tests compare against).
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.model.quantization import fp8_model
from actors.engine.model.quantization.fp8_checkpoint import checkpoint_format
from actors.engine.model.quantization.fp8_linear import Fp8Linear
from actors.engine.model.quantization.fp8_math import quantize_weight_torch

CPU_FP8 = {"device": "cpu", "dtype": "bfloat16", "quantization": "fp8"}


@pytest.fixture
def emulate_fp8(monkeypatch):
    """The device check passes on CPU (the tests' emulation)."""
    monkeypatch.setattr(fp8_model, "check_fp8_device", lambda device, dtype: None)


def _load(path: str, **options):
    from actors.engine.model.loader import load_model

    return load_model(path, EngineConfig(**{**CPU_FP8, **options}))


def _projections(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("_proj")}


# ---------------------------------------------------------------------- the option
def test_the_option_validates():
    assert EngineConfig(device="cpu").quantization is None
    assert EngineConfig(quantization="fp8", device="cuda").dtype == "bfloat16"
    for bad in ("FP8", "int8", 8, True):
        with pytest.raises(ValueError, match=r"engine\.quantization: must be None or 'fp8'"):
            EngineConfig(quantization=bad, device="cpu")
    with pytest.raises(ValueError, match=r"engine\.dtype: must be bfloat16"):
        EngineConfig(quantization="fp8", dtype="float16", device="cuda")
    EngineConfig.check({"quantization": "fp8"})  # what a job driver and RolloutPool run
    with pytest.raises(ValueError, match=r"engine\.quantization"):
        EngineConfig.check({"quantization": "fp4"})


def test_job_config_passes_the_option_to_the_actors():
    from jobs.config import JobConfig
    from jobs.runner import engine_options

    job = JobConfig(model="m", input="i.parquet", output="o", engine={"quantization": "fp8"})
    assert engine_options(job)["quantization"] == "fp8"
    bad = JobConfig(model="m", input="i.parquet", output="o", engine={"quantization": "nf4"})
    with pytest.raises(ValueError, match=r"config\.engine\.quantization"):
        engine_options(bad)


def test_rollout_pool_refuses_a_bad_value_before_starting_actors():
    from toolkit.rollout import RolloutPool

    with mock.patch("jobs.cluster.connect", side_effect=AssertionError("connected")), \
            pytest.raises(ValueError, match=r"engine\.quantization"):
        RolloutPool("m", engine={"quantization": "int4"}, num_gpus_per_actor=0)


# ---------------------------------------------------------------------- refusals
def _nothing_loads():
    refuse = mock.Mock(side_effect=AssertionError("the model was loaded"))
    return mock.patch("transformers.AutoModelForCausalLM.from_pretrained", refuse)


def test_cpu_is_refused_before_the_model_loads(tiny_llama):
    from actors.engine.llm_engine import Engine

    refused = pytest.raises(ValueError, match=r"engine\.quantization: 'fp8' needs a CUDA GPU "
                                              r"of compute capability >= 8\.9.*device is cpu")
    with _nothing_loads(), refused, mock.patch("transformers.AutoConfig.from_pretrained",
                                               side_effect=AssertionError("config read")):
        Engine(tiny_llama, {**CPU_FP8, "num_kv_blocks": 16})


def test_an_older_gpu_and_a_non_bf16_dtype_are_refused():
    cuda = torch.device("cuda:0")
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)), \
            mock.patch("torch.cuda.get_device_name", return_value="NVIDIA A100"), \
            pytest.raises(ValueError, match=r"NVIDIA A100\) has 8\.0"):
        fp8_model.check_fp8_device(cuda, torch.bfloat16)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        fp8_model.check_fp8_device(cuda, torch.bfloat16)
        with pytest.raises(ValueError, match=r"engine\.dtype: quantization 'fp8' computes in "
                                             r"bfloat16"):
            fp8_model.check_fp8_device(cuda, torch.float16)


# ---------------------------------------------------------------------- bf16 checkpoints
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_a_bf16_checkpoint_is_quantized_per_channel_at_load(arch, arch_model, emulate_fp8):
    import safetensors.torch

    path = arch_model(arch)
    stored = safetensors.torch.load_file(str(Path(path) / "model.safetensors"))
    loaded = _load(path)
    projections = _projections(loaded.model)
    assert len(projections) == 7 * loaded.num_layers
    assert all(type(m) is Fp8Linear for m in projections.values())
    assert loaded.quantization["fp8_layers"] == 7 * loaded.num_layers
    assert loaded.quantization["kept"] == [] and loaded.quantization["checkpoint"] is None
    for name, layer in projections.items():
        weight = stored[f"{name}.weight"].to(torch.bfloat16)
        q, scale = quantize_weight_torch(weight)
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale, scale[None])
        assert torch.equal(scale, weight.float().abs().amax(-1) / 448)
        # per row, e4m3 keeps the weight within 2^-4 of the row's largest magnitude
        err = (layer.dequantized_weight() - weight.float()).abs().amax(-1)
        assert (err <= weight.float().abs().amax(-1) / 16).all()
        if layer.bias is not None:
            assert torch.equal(layer.bias, stored[f"{name}.bias"].to(torch.bfloat16))
    # the LM head, the embeddings and the norms stay bf16
    lm_head = loaded.model.get_output_embeddings()
    assert lm_head.weight.dtype == torch.bfloat16 and type(lm_head) is torch.nn.Linear
    assert loaded.base_model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.base_model.norm.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------- FP8 checkpoints
def _write_fp8_checkpoint(src: str, dst: Path, quantization_config: dict, quantize) -> Path:
    """``src`` rewritten with its decoder projections quantized by ``quantize(name, w)``,
    which returns the tensors to store under ``<name>.weight`` and the scale name."""
    import shutil

    import safetensors.torch

    shutil.copytree(src, dst)
    stored = safetensors.torch.load_file(str(dst / "model.safetensors"))
    out = {}
    for key, value in stored.items():
        name = key[:-len(".weight")]
        if ".layers." in key and key.endswith("_proj.weight"):
            out.update(quantize(name, value.to(torch.bfloat16)))
        else:
            out[key] = value
    safetensors.torch.save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


COMPRESSED_CHANNEL = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True, "symmetric": True}}}}


def test_a_compressed_tensors_channel_checkpoint_loads_as_stored(tiny_llama, tmp_path,
                                                                 emulate_fp8):
    def channel(name, weight):
        q, scale = quantize_weight_torch(weight)
        return {f"{name}.weight": q, f"{name}.weight_scale": scale[:, None]}

    path = _write_fp8_checkpoint(tiny_llama, tmp_path / "ct", COMPRESSED_CHANNEL, channel)
    direct, at_load = _load(str(path)), _load(tiny_llama)
    assert direct.quantization["checkpoint"] == "compressed-tensors"
    assert direct.quantization["requantized_blocks"] == 0
    ours, theirs = _projections(direct.model), _projections(at_load.model)
    assert len(ours) == 7 * direct.num_layers
    for name, layer in ours.items():  # the same values as quantizing the bf16 weights here
        assert type(layer) is Fp8Linear
        assert torch.equal(layer.weight.view(torch.uint8), theirs[name].weight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, theirs[name].weight_scale)


def test_a_block_wise_fp8_checkpoint_is_dequantized_and_quantized_per_channel(
        tiny_llama, tmp_path, emulate_fp8):
    block = 32
    originals = {}

    def blockwise(name, weight):
        n, k = weight.shape
        tiles = weight.float().reshape(n // block, block, k // block, block)
        scale = tiles.abs().amax((1, 3)) / 448
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        originals[name] = weight.float()
        return {f"{name}.weight": (weight.float() / full).to(torch.float8_e4m3fn),
                f"{name}.weight_scale_inv": scale}

    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": [block, block]}
    path = _write_fp8_checkpoint(tiny_llama, tmp_path / "fp8", config, blockwise)
    loaded = _load(str(path))
    assert loaded.quantization["checkpoint"] == "fp8"
    assert loaded.quantization["requantized_blocks"] == 7 * loaded.num_layers
    for name, layer in _projections(loaded.model).items():
        want = originals[name]
        # two e4m3 roundings (the checkpoint's blocks, then our channels)
        err = (layer.dequantized_weight() - want).abs().amax(-1)
        assert (err <= want.abs().amax(-1) / 8).all()


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "awq", "bits": 4}, "quantized with 'awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({**COMPRESSED_CHANNEL, "format": "int-quantized"}, "format float-quantized"),
    ({**COMPRESSED_CHANNEL, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}}}}, "8-bit float"),
    ({**COMPRESSED_CHANNEL, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategies channel"),
])
def test_unclear_quantized_checkpoints_are_refused_before_loading(config, match, tiny_llama,
                                                                  tmp_path, emulate_fp8):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "q")
    data = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**data,
                                                            "quantization_config": config}))
    with _nothing_loads(), pytest.raises(ValueError, match=rf"engine\.quantization: .*{match}"):
        _load(str(tmp_path / "q"))


def test_checkpoint_format_of_an_unquantized_config_is_none():
    assert checkpoint_format(mock.Mock(spec=[])) is None
    fmt = checkpoint_format(mock.Mock(quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"]}))
    assert fmt.block == (128, 128) and fmt.scale_suffix == "weight_scale_inv"
    assert fmt.ignored == ("lm_head",)
