"""raw_logprobs / temperature_logprobs of sampled tokens against an fp32 HF forward over
prompt + output (the RL trainer's replay), whatever the row's own logprobs mode."""

from __future__ import annotations

import pytest
import torch

from tests.actors.helpers import hf_logits, make_engine, random_prompts

ATOL = 1e-5


def check_against_hf(model, prompt, out, temperature):
    """Both columns equal log_softmax of the HF logits (and of logits / T) at the sampled ids."""
    tokens = out.output_token_ids
    assert out.finish_reason in ("length", "stop") and len(tokens) > 0
    assert len(out.raw_logprobs) == len(out.temperature_logprobs) == len(tokens)
    logits = hf_logits(model, prompt + tokens)[len(prompt) - 1:-1]  # rows predicting outputs
    index = torch.tensor(tokens)[:, None]
    raw = torch.log_softmax(logits, -1).gather(1, index)[:, 0]
    temp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, index)[:, 0]
    torch.testing.assert_close(torch.tensor(out.raw_logprobs), raw, rtol=0, atol=ATOL)
    # logits / T carry the two forwards' fp32 differences divided by T as well
    scale = 1.0 / min(temperature or 1.0, 1.0)
    torch.testing.assert_close(torch.tensor(out.temperature_logprobs), temp, rtol=0,
                               atol=ATOL * scale)


PARAMS = [
    # random rows with n forks sharing the prompt, greedy, and rows whose own mode is
    # processed (the torch pipeline then overwrites the logits it gets in place)
    dict(n=3, temperature=0.7, top_k=40, top_p=0.9, seed=5, max_tokens=12),
    dict(temperature=0.0, max_tokens=12),
    dict(temperature=1.6, min_p=0.02, repetition_penalty=1.3, logit_bias={7: 4.0}, seed=9,
         max_tokens=12, logprobs=2, logprobs_mode="processed_logprobs"),
    dict(temperature=0.4, presence_penalty=0.5, seed=3, max_tokens=12, logprobs=0,
         logprobs_mode="raw_logits"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_columns_equal_an_fp32_hf_forward(arch, arch_model, hf_reference):
    path = arch_model(arch)
    engine = make_engine(path)
    prompts = random_prompts([7, 19, 3, 26], 500, seed=31)
    outs = engine.generate([(i, p, PARAMS[i]) for i, p in enumerate(prompts)],
                           token_logprobs=True)
    model = hf_reference(path)
    assert len(outs) == 6
    for out in outs:
        check_against_hf(model, prompts[out.id], out, PARAMS[out.id]["temperature"])
    # the row's own column is untouched by the extra ones
    processed = next(o for o in outs if o.id == 2)
    assert processed.logprobs != processed.raw_logprobs
    assert len(processed.top_logprobs) == processed.num_output_tokens


def test_columns_are_absent_unless_asked_and_survive_preemption(tiny_llama, hf_reference):
    engine = make_engine(tiny_llama, max_model_len=80, num_kv_blocks=14, block_size=8,
                         max_num_batched_tokens=32)
    prompts = random_prompts([30, 28, 25, 31], 500, seed=32)
    params = {"temperature": 0.9, "seed": 1, "max_tokens": 40, "ignore_eos": True}
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)], token_logprobs=True)
    assert engine.stats.num_preemptions > 0
    model = hf_reference(tiny_llama)
    for out in outs:
        check_against_hf(model, prompts[out.id], out, 0.9)
    plain = engine.generate([(0, prompts[0], params)])
    assert plain[0].raw_logprobs is None and plain[0].temperature_logprobs is None


def test_triton_sampler_backend_gives_the_same_columns(tiny_llama, hf_reference):
    """Also when a processed-mode row sends the step to the torch fallback (in place)."""
    engine = make_engine(tiny_llama, sampler_backend="triton")
    prompts = random_prompts([9, 5], 500, seed=33)
    params = [{"temperature": 0.8, "top_p": 0.9, "seed": 2, "max_tokens": 6, "n": 2},
              {"temperature": 0.5, "top_k": 9, "seed": 4, "max_tokens": 6, "logprobs": 0,
               "logprobs_mode": "processed_logprobs"}]
    outs = engine.generate([(i, p, params[i]) for i, p in enumerate(prompts)],
                           token_logprobs=True)
    model = hf_reference(tiny_llama)
    assert len(outs) == 3
    for out in outs:
        check_against_hf(model, prompts[out.id], out, params[out.id]["temperature"])
