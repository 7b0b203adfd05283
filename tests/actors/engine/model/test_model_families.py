"""The model families the engine once got wrong or refused, with their distinguishing features
switched on and strong enough to matter: granite / granitemoe (logits_scaling and the other
multipliers), gemma2 (attention soft-capping, final soft-capping, a sliding window of 8),
gpt_oss (attention sinks, experts, window 8), deepseek_v3 (MLA: keys 24 wide, values 16;
experts), falcon (attention through torch's SDPA in transformers releases whose falcon calls
it itself, as 5.17 does; later ones route it through the registry) and stablelm (partial
rotary, qkv bias). Greedy tokens equal HF's and raw logprobs are within 1e-4 (fp32, CPU), over
chunked prefill (budget 16 < the longest prompt) and 12 decode steps; each feature is shown
to be active (turning it off in the engine breaks parity)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine
from sampler import SamplingParams
from tests.actors.engine.model.model_sweep import LOGPROB_ATOL, build


def _falcon_route() -> str | None:
    """How the installed transformers' falcon calls attention ("sdpa" in 5.17, "registry"
    from 5.25 on)."""
    from transformers import FalconForCausalLM

    from actors.engine.model.model_support import attention_route

    return attention_route(FalconForCausalLM)

FAMILIES = {
    "granite": dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.2),
    "granitemoe": dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5,
                       attention_multiplier=0.2),
    "gemma2": dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=8,
                   query_pre_attn_scalar=16),
    "gpt_oss": dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, first_k_dense_replace=1),
    "falcon": dict(),
    "stablelm": dict(use_qkv_bias=True),
}
LENGTHS = [3, 9, 21, 30]
NEW = 12


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from toolkit.tiny_model import train_tokenizer

    path = tmp_path_factory.mktemp("family-tokenizer")
    train_tokenizer(512).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    built: dict[str, str] = {}

    def make(model_type: str) -> str:
        if model_type not in built:
            path = tmp_path_factory.mktemp(model_type)
            build(model_type, path, **FAMILIES[model_type])
            built[model_type] = str(path)
        return built[model_type]

    return make


def _run(path: str, tokenizer_dir: str):
    engine = Engine(path, {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4,
                           "num_kv_blocks": 128, "max_model_len": 64,
                           "tokenizer": tokenizer_dir})
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)],
                           token_logprobs=True)
    return engine, prompts, outs


def _errors(path: str, prompts, outs) -> tuple[float, float]:
    """(worst greedy margin: HF's best logprob minus the chosen token's, worst raw logprob
    difference) against HF's eager fp32 forward over prompt + outputs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    margin = diff = 0.0
    for out in outs:
        prompt, tokens = prompts[out.id], out.output_token_ids
        assert len(tokens) == NEW
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        got = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        margin = max(margin, (logp.max(-1).values - got).max().item())
        diff = max(diff, (torch.tensor(out.raw_logprobs) - got).abs().max().item())
    return margin, diff


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_matches_hf(model_type, family_model, tokenizer_dir):
    path = family_model(model_type)
    engine, prompts, outs = _run(path, tokenizer_dir)
    loaded = engine.loaded
    specs = loaded.layer_specs
    if model_type == "gemma2":
        assert {s.softcap for s in specs.values()} == {2.0}
        assert {s.sliding_window for s in specs.values()} == {8, None}
    if model_type == "gpt_oss":
        assert all(s.has_sinks for s in specs.values())
        assert {s.sliding_window for s in specs.values()} == {8, None}
    if model_type == "deepseek_v3":
        assert (loaded.head_dim, loaded.value_dim) == (24, 16)
        assert engine.executor.runner.kv_cache.pool.shape[-1] == 24
    if model_type == "falcon":
        assert loaded.attention_route == _falcon_route()
    if model_type in ("gemma2", "granite", "granitemoe"):  # more than the LM head alone
        assert loaded.head.direct is None
    if model_type.startswith("granite"):  # the head path divides by logits_scaling
        hidden = torch.randn(3, loaded.model.config.hidden_size)
        torch.testing.assert_close(loaded.head(hidden),
                                   loaded.model.lm_head(hidden) / 4.0)
    margin, diff = _errors(path, prompts, outs)
    assert margin <= LOGPROB_ATOL, f"{model_type}: greedy token off HF's argmax by {margin}"
    assert diff <= LOGPROB_ATOL, f"{model_type}: raw logprobs off by {diff}"


@pytest.mark.parametrize("model_type, feature", [("gemma2", "softcap"),
                                                 ("gpt_oss", "sinks"),
                                                 ("gemma2", "sliding_window")])
def test_dropping_the_feature_breaks_parity(model_type, feature, family_model,
                                            tokenizer_dir, monkeypatch):
    """The parity test can fail: the engine without soft-capping / sinks / the window."""
    from actors.engine.model.attention.torch_backend import TorchAttentionBackend

    original = TorchAttentionBackend.forward

    def without(self, *args, **kwargs):
        kwargs[feature] = None
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TorchAttentionBackend, "forward", without)
    path = family_model(model_type)
    _, prompts, outs = _run(path, tokenizer_dir)
    margin, diff = _errors(path, prompts, outs)
    assert diff > 1e-2


def test_mla_value_rows_stay_within_their_width(family_model, tokenizer_dir):
    """Values are 16 wide in a 24-wide pool: the padding of every value row stays zero."""
    engine, _, _ = _run(family_model("deepseek_v3"), tokenizer_dir)
    pool = engine.executor.runner.kv_cache.pool          # [L, N, 2, bs, H, 24]
    assert pool[:, :, 1].abs().sum() > 0
    assert pool[:, :, 1, ..., 16:].abs().max() == 0


def test_plain_head_path_calls_the_output_embedding_directly(llama_engine):
    loaded = llama_engine.loaded
    assert loaded.head.direct is loaded.model.get_output_embeddings()
    hidden = torch.randn(5, loaded.model.config.hidden_size)
    assert torch.equal(loaded.head(hidden), loaded.head.through_model(hidden))


def test_sdpa_routed_model_is_plain_hf_outside_the_engine(family_model, tokenizer_dir):
    """falcon's SDPA calls reach the paged attention only inside an engine step: a plain
    forward of the engine's model equals HF's own."""
    from transformers import AutoModelForCausalLM

    if _falcon_route() != "sdpa":
        import transformers

        pytest.skip(f"transformers {transformers.__version__}: falcon goes through the "
                    "attention registry, not SDPA")

    path = family_model("falcon")
    engine, _, _ = _run(path, tokenizer_dir)
    ids = torch.tensor([[5, 9, 33, 2, 71, 8]])
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(engine.loaded.model(ids).logits, hf(ids).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type, overrides, attribute", [
    ("falcon", dict(alibi=True), "config.alibi=True"),
    ("llama4_text", dict(attention_chunk_size=8), "config.attention_chunk_size=8"),
    ("qwen3_next", dict(), "config.layer_types="),
])
def test_refusals_name_the_attribute_before_loading(model_type, overrides, attribute,
                                                    tmp_path, tokenizer_dir, monkeypatch):
    import transformers

    from actors.engine.model.loader import UnsupportedModelError
    from tests.actors.engine.model.model_sweep import tiny_config

    tiny_config(model_type, **overrides).save_pretrained(tmp_path)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(UnsupportedModelError, match=rf"model_type='{model_type}'.*{attribute}"):
        Engine(str(tmp_path), {"num_kv_blocks": 16, "max_model_len": 32,
                               "tokenizer": tokenizer_dir})
