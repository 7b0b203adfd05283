"""The engine's logits equal the HF model's own forward at every position: packed prefill,
chunked prefill (token budget smaller than a prompt) and 30 decode steps, for each arch.

The prefill samples the first token; decode step k feeds back sampled token k, so 31 sampled
tokens mean 30 decode forwards (the 31st token is never fed back)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine
from sampler import SamplingParams
from tests.actors.helpers import hf_logits, random_prompts

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def capture_logits(engine: Engine) -> dict:
    """Wraps the engine's runner so every computed position's logits are recorded:
    {(request_id, sample_index): {position: logits row}}."""
    runner = engine.executor.runner
    seen: dict = {}
    original_execute = runner.execute
    current: list = []

    def launch_model(sched, prev, _orig=engine.executor.launch_model):
        current[:] = [sched]
        return _orig(sched, prev)

    def execute(inputs, prev_token_ids):
        hidden = original_execute(inputs, prev_token_ids)
        logits = runner.compute_logits(hidden)
        sched = current[0]
        for i, chunk in enumerate(sched.chunks):
            seq = chunk.seq
            rows = seen.setdefault((seq.request.request_id, seq.sample_index), {})
            base = int(inputs.query_start_loc[i])
            for j in range(chunk.num_tokens):
                assert int(inputs.positions[base + j]) == chunk.start + j
                rows[chunk.start + j] = logits[base + j].clone()
        return hidden

    engine.executor.launch_model = launch_model
    runner.execute = execute
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_forward(arch, arch_model, hf_reference):
    path = arch_model(arch)
    engine = Engine(path, {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4,
                           "num_kv_blocks": 128, "max_model_len": 128})
    seen = capture_logits(engine)
    vocab = engine.loaded.vocab_size
    prompts = random_prompts([3, 9, 21, 40, 14, 5], vocab, seed=1)
    decode_steps = 30
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, temperature=0.0)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    assert engine.stats.num_steps > decode_steps
    assert max(map(len, prompts)) > 16  # a prompt is longer than the token budget: chunked

    ref = hf_reference(path)
    worst = 0.0
    for out in outs:
        assert out.num_output_tokens == decode_steps + 1
        full = prompts[out.id] + out.output_token_ids
        rows = seen[(out.id, 0)]
        # every input position was computed: prompt positions (prefill, maybe chunked) and
        # the 30 decode inputs (the last sampled token is never fed back)
        assert sorted(rows) == list(range(len(full) - 1))
        assert len(rows) - len(prompts[out.id]) == decode_steps
        expected = hf_logits(ref, full)[:-1]
        got = torch.stack([rows[p] for p in range(len(full) - 1)])
        worst = max(worst, (got - expected).abs().max().item())
    assert worst < 1e-4, f"{arch}: max |engine - HF| = {worst}"


def test_sliding_window_is_exercised(arch_model, hf_reference):
    """The parity test can fail: ignoring qwen2's window breaks it."""
    from actors.engine.model.attention.torch_backend import TorchAttentionBackend

    path = arch_model("qwen2")
    engine = Engine(path, {"max_num_seqs": 2, "block_size": 4, "num_kv_blocks": 64,
                           "max_model_len": 64})
    seen = capture_logits(engine)
    backend = engine.executor.runner.backend
    original = TorchAttentionBackend.forward

    def no_window(plan, layer_idx, q, k, v, *, scaling, sliding_window=None, **extra):
        return original(backend, plan, layer_idx, q, k, v, scaling=scaling, sliding_window=None,
                        **extra)

    backend.forward = no_window
    prompt = random_prompts([20], engine.loaded.vocab_size, seed=3)[0]
    out = engine.generate([(0, prompt, SamplingParams(max_tokens=4, temperature=0.0))])[0]
    full = prompt + out.output_token_ids
    got = torch.stack([seen[(0, 0)][p] for p in range(len(full) - 1)])
    err = (got - hf_logits(hf_reference(path), full)[:-1]).abs().max().item()
    assert err > 1e-2
