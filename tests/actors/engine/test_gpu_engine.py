"""The engine on a CUDA GPU (FlashInfer attention, CUDA-graph decode) against HF in bf16.

Run with ``pytest -m gpu tests/actors`` on a CUDA machine with flashinfer installed. The tiny
models are Qwen2 with head_dim 64 (hidden 256, 4/2 heads), random weights.

Tolerances (bf16): logits are compared with HF's own forward in float32. These random models
(weights of std 0.2) are badly conditioned: HF's own bf16 forward misses its float32 forward by
up to ~10% of the largest logit. The engine's error (max |engine - fp32| over all positions,
over the largest |fp32 logit|) must stay within twice HF's bf16 error. Greedy parity: each
output equals HF's greedy bf16 generation up to its first difference, where the two candidates
must be a bf16 near-tie: their float32 gap at most 4x the bf16 logit error HF's forward makes
on that sequence; at least 24 of 64 outputs match in full.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine
from sampler import SamplingParams
from tests.actors.helpers import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)


@pytest.fixture(scope="module")
def gpu_model(tiny_model_factory):
    def make(window: int | None = None) -> str:
        extra = {"sliding_window": window} if window else {}
        return tiny_model_factory("qwen2", **GPU_SHAPE, **extra)
    return make


@pytest.fixture(scope="module")
def hf_models():
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def load(path: str, dtype: torch.dtype):
        key = (path, dtype)
        if key not in cache:
            impl = "eager" if dtype == torch.float32 else "sdpa"
            cache[key] = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=impl).cuda().eval()
        return cache[key]
    return load


def _engine(path: str, **options) -> Engine:
    config = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 512,
              "num_kv_blocks": 1024, **options}
    return Engine(path, config)


def _capture_logits(engine: Engine) -> dict:
    """{(request id, position): logits row} for every position the engine computed."""
    runner = engine.executor.runner
    seen: dict = {}
    current: list = []
    launch_model, execute = engine.executor.launch_model, runner.execute

    def wrapped_launch_model(sched, prev):
        current[:] = [sched]
        return launch_model(sched, prev)

    def wrapped_execute(inputs, prev):
        hidden = execute(inputs, prev)
        logits = runner.compute_logits(hidden).float()
        for i, chunk in enumerate(current[0].chunks):
            base = int(inputs.query_start_loc[i])
            for j in range(chunk.num_tokens):
                seen[(chunk.seq.request.request_id, chunk.start + j)] = logits[base + j]
        return hidden

    engine.executor.launch_model, runner.execute = wrapped_launch_model, wrapped_execute
    return seen


@pytest.mark.parametrize("window", [None, 8])
def test_logits_match_hf_in_bf16(gpu_model, hf_models, window):
    path = gpu_model(window)
    engine = _engine(path, max_num_batched_tokens=64, num_kv_blocks=None)  # chunked prefill
    assert engine.info()["attention_backend"] == "flashinfer" and engine.info()["cuda_graphs"]
    seen = _capture_logits(engine)
    prompts = random_prompts([3, 9, 21, 80, 14, 130], engine.loaded.vocab_size, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    assert engine.executor.runner.graphs.num_replays > 0
    ref32, ref16 = hf_models(path, torch.float32), hf_models(path, torch.bfloat16)
    ours_err, hf_err = logit_errors(outs, prompts, seen, ref32, ref16)
    print(f"window={window}: engine {ours_err:.2e}, HF bf16 {hf_err:.2e} (of max |logit|)")
    assert ours_err <= 2 * hf_err + 1e-3


def test_greedy_matches_hf_generate_over_64_prompts(gpu_model, hf_models):
    path = gpu_model()
    engine = _engine(path, max_num_seqs=64)
    lengths = [5 + (37 * i) % 120 for i in range(64)]
    prompts = random_prompts(lengths, engine.loaded.vocab_size, seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
    ref16, ref32 = hf_models(path, torch.bfloat16), hf_models(path, torch.float32)
    full_matches = 0
    for out in outs:
        prompt = torch.tensor([prompts[out.id]], device="cuda")
        with torch.no_grad():
            expected = ref16.generate(prompt, do_sample=False, max_new_tokens=24,
                                      min_new_tokens=24, pad_token_id=0)[0, prompt.shape[1]:]
        expected = expected.tolist()
        if out.output_token_ids == expected:
            full_matches += 1
            continue
        p = next(i for i, (a, b) in enumerate(zip(out.output_token_ids, expected)) if a != b)
        prefix = torch.tensor([prompts[out.id] + expected[:p]], device="cuda")
        with torch.no_grad():
            exact = ref32(prefix).logits[0].float()
            hf_err = (ref16(prefix).logits[0].float() - exact).abs().max().item()
        gap = abs(exact[-1, out.output_token_ids[p]] - exact[-1, expected[p]]).item()
        # a flip is a bf16 near-tie: the fp32 gap is within a few times the bf16 error that
        # HF's own forward makes on this sequence
        assert gap <= 4 * hf_err, (out.id, p, gap, hf_err)
    print(f"greedy: {full_matches}/64 outputs equal HF's in full")
    assert full_matches >= 24


def test_seeded_sampling_same_with_and_without_graphs(gpu_model):
    """16 sequences decode in lockstep (a bucket size: graph and eager run the same GEMM
    shapes), so every token and logprob must be identical."""
    path = gpu_model()
    prompts = random_prompts([7 + 11 * i for i in range(16)], 400, seed=3)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9,
                             seed=100 + i, logprobs=1) for i in range(16)]
    results = {}
    for graphs in (True, False):
        engine = _engine(path, cuda_graphs=graphs)
        outs = engine.generate([(i, p, params[i]) for i, p in enumerate(prompts)])
        graph_runner = engine.executor.runner.graphs
        assert (graph_runner is not None and graph_runner.num_replays >= 39) == graphs
        results[graphs] = [(o.output_token_ids, o.logprobs) for o in outs]
        del engine
    assert results[True] == results[False]
    assert len({tuple(t) for t, _ in results[True]}) == 16


def test_fused_layers_on_by_default_and_outputs_as_without_them(gpu_model):
    """The fused RMSNorm / rotary / SiLU kernels are in the model on CUDA; greedy outputs and
    raw logprobs match an engine without them (the norm may differ by one bf16 ulp, so an
    output may leave the other at a near-tie: most must match in full)."""
    path = gpu_model()
    prompts = random_prompts([5 + 9 * i for i in range(16)], 400, seed=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=0)
    results = {}
    for fused in (True, False):
        engine = _engine(path, fused_layers=None if fused else False)
        info = engine.info()["fused_layers"]
        if fused:
            assert info["rms_norm"] == 2 * 2 + 1 and info["silu_mul"] == 2 and info["rotary"]
        else:
            assert info is None
        outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)])
        results[fused] = [(o.output_token_ids, o.logprobs) for o in outs]
        del engine
    assert_paths_agree(results, "fused vs plain")


def position_errors(outs, prompts, seen, ref32, ref16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (every output's prompt + tokens, in order): the largest error of the
    engine's logits (``seen``, by (id, position)) and of HF's own bf16 forward against HF's
    fp32 forward, relative to the largest |fp32 logit| of that output."""
    ours, hf = [], []
    for out in outs:
        full = prompts[out.id] + out.output_token_ids
        ids = torch.tensor([full], device="cuda")
        with torch.no_grad():
            exact = ref32(ids).logits[0, :-1].float()
            bf16 = ref16(ids).logits[0, :-1].float()
        got = torch.stack([seen[(out.id, p)] for p in range(len(full) - 1)])
        scale = exact.abs().max()
        ours.append(((got - exact).abs().amax(-1) / scale).cpu())
        hf.append(((bf16 - exact).abs().amax(-1) / scale).cpu())
    return torch.cat(ours), torch.cat(hf)


def logit_errors(outs, prompts, seen, ref32, ref16) -> tuple[float, float]:
    """The largest of :func:`position_errors` for the engine and for HF's bf16 forward."""
    ours, hf = position_errors(outs, prompts, seen, ref32, ref16)
    return ours.max().item(), hf.max().item()


def assert_paths_agree(results: dict, label: str) -> None:
    """``results[True]`` / ``results[False]``: (token ids, logprobs) of 16 greedy outputs of
    a fused path and the plain one: at least 12 identical, first-token logprobs within 0.05."""
    same = sum(a[0] == b[0] for a, b in zip(results[True], results[False]))
    print(f"{label}: {same}/16 greedy outputs identical")
    assert same >= 12
    first = torch.tensor([lp[0] for _, lp in results[True]])
    torch.testing.assert_close(first, torch.tensor([lp[0] for _, lp in results[False]]),
                               atol=0.05, rtol=0)
