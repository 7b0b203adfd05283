"""Greedy outputs equal HF ``generate(do_sample=False)`` token for token, with continuous
batching active (more prompts than max_num_seqs, chunked prefill, mixed steps)."""

from __future__ import annotations

import torch

from sampler import SamplingParams
from tests.actors.helpers import make_engine, random_prompts

MAX_NEW = 24


def test_greedy_matches_hf_generate(tiny_llama, hf_reference):
    engine = make_engine(tiny_llama, max_num_seqs=5, max_num_batched_tokens=32)
    lengths = [1, 3, 5, 8, 13, 21, 34, 2, 7, 11, 17, 29, 40, 4, 9, 15]
    prompts = random_prompts(lengths, engine.loaded.vocab_size, seed=7)
    # text prompts too, encoded by the engine's tokenizer
    texts = ["The quick brown fox", "Once upon a time there was"]
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

    requests = [(i, p, params) for i, p in enumerate(prompts + texts)]
    seen_batches = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        seen_batches.append(len(out.chunks))
        return out

    engine.scheduler.schedule = schedule
    outs = engine.generate(requests)
    assert len(outs) == len(requests)
    assert max(seen_batches) == 5  # batch full: more prompts than max_num_seqs
    assert engine.stats.num_steps > 2 * MAX_NEW  # requests joined as others finished

    ref = hf_reference(tiny_llama)
    eos = ref.generation_config.eos_token_id
    all_prompts = prompts + [tok.encode(t) for t in texts]
    for out in outs:
        prompt = all_prompts[out.id]
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), do_sample=False,
                               max_new_tokens=MAX_NEW, pad_token_id=eos)
        expected = gen[0, len(prompt):].tolist()
        assert out.output_token_ids == expected, f"request {out.id}"
        assert out.num_prompt_tokens == len(prompt)
        reason = "stop" if expected[-1] == eos else "length"
        assert out.finish_reason == reason
