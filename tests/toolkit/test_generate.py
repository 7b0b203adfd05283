"""``toolkit.generate``: prompts of every kind, per-prompt params, ordering, engine reuse."""

from __future__ import annotations

import sys

import pytest
import torch

import toolkit
from toolkit import SamplingParams, generate
from sampler.seeding import sample_seed
from toolkit.generate import clear_engine_cache

torch.set_num_threads(1)

OPTIONS = {"max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": 128}


def test_prompt_kinds_order_and_ids(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompts = ["The quick brown fox", [5, 6, 7, 8], chat]
    params = [SamplingParams(max_tokens=4, n=3, seed=1), {"max_tokens": 2, "seed": 2},
              SamplingParams(temperature=0.0, max_tokens=5)]
    outs = generate(prompts, params, model=tiny_llama, **OPTIONS)
    assert [(o.id, o.sample_index) for o in outs] == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0)]
    assert [o.num_output_tokens for o in outs] == [4, 4, 4, 2, 5]
    assert outs[0].num_prompt_tokens == len(tok.encode("The quick brown fox"))
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    as_ids = tok.encode(rendered, add_special_tokens=False)
    assert outs[4].num_prompt_tokens == len(as_ids)
    again = generate([as_ids], SamplingParams(temperature=0.0, max_tokens=5), model=tiny_llama,
                     **OPTIONS)
    assert again[0].output_token_ids == outs[4].output_token_ids
    # each of n samples its own seed, sample 0 the request's
    assert [o.seed for o in outs[:3]] == [sample_seed(1, j) for j in range(3)]
    assert outs[0].seed == 1 and outs[3].seed == 2
    for o in outs:
        assert o.output_text == tok.decode(o.output_token_ids, skip_special_tokens=True)


def test_single_prompt_forms_and_engine_reuse(tiny_llama):
    from toolkit import generate as gen_module_attr

    assert gen_module_attr is generate and toolkit.generate is generate
    one = generate("Hello", SamplingParams(max_tokens=3, seed=4), model=tiny_llama, **OPTIONS)
    gen_module = sys.modules["toolkit.generate"]  # the submodule, not the function
    engine = gen_module._cached[1]
    same = generate(["Hello"], SamplingParams(max_tokens=3, seed=4), model=tiny_llama,
                    **OPTIONS)
    assert gen_module._cached[1] is engine  # loaded once for the same model and options
    assert one[0].output_token_ids == same[0].output_token_ids
    chat = generate([{"role": "user", "content": "hi"}], {"max_tokens": 2, "seed": 1},
                    model=tiny_llama, **OPTIONS)
    assert len(chat) == 1 and chat[0].num_output_tokens == 2
    clear_engine_cache()
    assert gen_module._cached is None


def test_bad_prompt_is_an_error_row_and_bad_options_raise(tiny_llama):
    outs = generate(["fine", ""], SamplingParams(max_tokens=2, seed=0), model=tiny_llama,
                    **OPTIONS)
    assert outs[0].error is None and outs[1].finish_reason == "error"
    assert "empty" in outs[1].error
    with pytest.raises(ValueError, match="unknown option"):
        generate(["x"], model=tiny_llama, max_seqs=3)
    with pytest.raises(ValueError, match="1 entries for 2 prompts"):
        generate(["a", "b"], [None], model=tiny_llama, **OPTIONS)


def test_structured_outputs(tiny_llama):
    from toolkit import StructuredOutputsParams

    so = StructuredOutputsParams(choice=["left", "right"])
    params = [SamplingParams(max_tokens=20, seed=1, structured_outputs=so),
              {"max_tokens": 20, "seed": 2, "structured_outputs": {"regex": "[ab]{4}"}}]
    outs = generate(["Go", "Go"], params, model=tiny_llama, **OPTIONS)
    assert outs[0].output_text in ("left", "right") and outs[0].finish_reason == "stop"
    assert len(outs[1].output_text) == 4 and set(outs[1].output_text) <= {"a", "b"}


def test_tensor_parallel_generate_and_no_rank_left_behind(tiny_llama):
    import os

    gen_module = sys.modules["toolkit.generate"]

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["Hello there", [5, 6, 7, 8]]
    one = [o.output_token_ids for o in generate(prompts, params, model=tiny_llama, **OPTIONS,
                                                  device="cpu")]
    two = generate(prompts, params, model=tiny_llama, device="cpu", tensor_parallel_size=2,
                   **OPTIONS)
    assert [o.output_token_ids for o in two] == one
    engine = gen_module._cached[1]
    (pid,) = engine.replica.pids
    os.kill(pid, 0)  # alive while the engine is kept
    clear_engine_cache()
    assert engine.replica.ranks.procs[0].poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
