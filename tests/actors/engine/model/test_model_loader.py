"""Model loading: the four reference architectures run on our attention; models that cannot
(no attention-backend support, encoder-decoder, not a causal LM) get a clear error."""

from __future__ import annotations

import pytest
import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.llm_engine import Engine
from actors.engine.model.loader import ATTENTION_NAME, UnsupportedModelError, load_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_reference_architectures_load_on_our_attention(arch, arch_model):
    loaded = load_model(arch_model(arch), EngineConfig(device="cpu"))
    assert loaded.model.config._attn_implementation == ATTENTION_NAME
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.vocab_size == 512 and loaded.num_layers == 2
    assert loaded.eos_token_ids == [loaded.tokenizer.eos_token_id]
    assert loaded.head_dim == (32 if arch == "qwen3" else 16)  # qwen3: config.head_dim
    # a plain forward under our attention name (no step metadata) refuses to run
    with pytest.raises(RuntimeError, match="without step metadata"):
        loaded.model(torch.tensor([[5, 6, 7]]))


def _save(tmp_path, config):
    import transformers

    from toolkit.tiny_model import train_tokenizer

    model = transformers.AutoModelForCausalLM.from_config(config) \
        if not config.is_encoder_decoder else \
        transformers.AutoModelForSeq2SeqLM.from_config(config)
    model.save_pretrained(tmp_path)
    train_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("name, make, message", [
    ("bloom", lambda t: t.BloomConfig(vocab_size=512, hidden_size=32, n_layer=1, n_head=2),
     r"BloomForCausalLM.*attention-function registry"),
    ("mamba", lambda t: t.MambaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1,
                                       state_size=4),
     r"MambaForCausalLM.*attention-function registry"),
    ("t5", lambda t: t.T5Config(vocab_size=512, d_model=32, d_ff=64, num_layers=1,
                                num_heads=2, d_kv=16),
     r"T5.*encoder-decoder"),
])
def test_unsupported_architectures_get_a_clear_error(tmp_path, name, make, message):
    import transformers

    path = _save(tmp_path, make(transformers))
    with pytest.raises(UnsupportedModelError, match=message):
        Engine(path, {"num_kv_blocks": 16, "max_model_len": 32})


def test_gpt2_runs_and_matches_hf_generate(tmp_path):
    import transformers

    from sampler import SamplingParams

    cfg = transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=2,
                                  n_positions=64)
    path = _save(tmp_path, cfg)
    engine = Engine(path, {"num_kv_blocks": 16, "max_model_len": 64, "block_size": 4})
    assert engine.info()["architecture"].startswith("GPT2LMHeadModel")
    prompt = [5, 17, 33, 2, 99, 7]
    out = engine.generate([(0, prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                      ignore_eos=True))])[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                min_new_tokens=10, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.output_token_ids == expected


def test_probe_refuses_layers_that_bypass_our_attention(tiny_llama):
    from actors.engine.builder import probe_attention_layers

    engine = Engine(tiny_llama, {"num_kv_blocks": 16, "max_model_len": 64})
    runner = engine.executor.runner
    probe_attention_layers(runner)  # passes as loaded
    runner.loaded.model.model.layers[1].self_attn.layer_idx = 0  # two layers report 0
    with pytest.raises(UnsupportedModelError, match="do not all go through"):
        probe_attention_layers(runner)


def test_engine_config_rejects_unknown_and_bad_values():
    with pytest.raises(ValueError, match="unknown option.*'max_seqs'"):
        EngineConfig.from_dict({"max_seqs": 4})
    with pytest.raises(ValueError, match="engine.block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="engine.dtype"):
        EngineConfig(dtype="fp8")
    cfg = EngineConfig.coerce({"max_num_seqs": 3})
    assert cfg.max_num_seqs == 3 and cfg.device in ("cpu", "cuda")
    assert EngineConfig(device="cpu").dtype == "float32"
    assert EngineConfig.coerce(cfg) is cfg


def test_checking_options_names_the_bad_one_and_resolves_nothing():
    """What a job driver or rollout pool runs on the options it ships: the same errors as
    ``from_dict``, the mapping untouched (``device: auto`` is resolved on the actor)."""
    for bad, match in (({"max_seqs": 4}, "unknown option.*'max_seqs'"),
                       ({"block_size": 0}, "engine.block_size"),
                       ({"dtype": "fp8", "device": "auto"}, "engine.dtype"),
                       ({"device": "tpu"}, "engine.device")):
        with pytest.raises(ValueError, match=match):
            EngineConfig.check(bad)
    options = {"device": "auto", "dtype": "auto", "max_num_seqs": 8}
    assert EngineConfig.check(options) is None
    assert options == {"device": "auto", "dtype": "auto", "max_num_seqs": 8}
    EngineConfig.check({"device": "cuda:1", "dtype": "float16"})
    EngineConfig.check(None)


def test_missing_model_fails_with_the_loader_error(tmp_path):
    with pytest.raises(OSError):
        Engine(str(tmp_path / "nope"))
