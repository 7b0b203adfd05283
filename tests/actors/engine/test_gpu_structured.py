"""Structured outputs on a CUDA GPU: valid through the Triton and FlashInfer sampler backends
and under CUDA-graph decode; seeded rows equal with and without graphs and alone vs batched.

Run with ``pytest -m gpu tests/actors/engine/test_gpu_structured.py`` (flashinfer and llguidance
installed)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine
from sampler import SamplingParams
from tests.actors.helpers import random_prompts
from tests.actors.engine.structured_checks import (ARITHMETIC_LARK, DATE_REGEX, PERSON_SCHEMA,
                                            check_output, compile_first)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
KINDS = [
    {"json": PERSON_SCHEMA, "disable_any_whitespace": True},
    {"regex": DATE_REGEX},
    {"choice": ["yes", "no", "it depends"]},
    {"grammar": ARITHMETIC_LARK},
    {"json_object": True, "disable_any_whitespace": True},
]


def _engine(path: str, **config) -> Engine:
    return Engine(path, {"max_num_seqs": 32, "max_model_len": 256, "num_kv_blocks": 512,
                         **config})


def _requests(seeded: bool = True) -> list:
    prompts = random_prompts([5 + 3 * i for i in range(20)], 400, seed=9)
    out = []
    for i, prompt in enumerate(prompts):
        so = KINDS[i % len(KINDS)] if i % 4 != 3 else None  # every 4th row unconstrained
        out.append((i, prompt, SamplingParams(
            temperature=1.0, top_p=0.95, max_tokens=120, seed=50 + i if seeded else None,
            structured_outputs=so, ignore_eos=so is None, logprobs=1)))
    return out


def _check(outs, requests) -> None:
    stopped = 0
    for out, (_, _, params) in zip(outs, requests):
        assert out.error is None and out.finish_reason in ("stop", "length")
        so = params.structured_outputs
        if so is not None and out.finish_reason == "stop":
            stopped += 1
            check_output(out, so.to_dict())
    assert stopped >= 10


@pytest.fixture(scope="module")
def gpu_model(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2", **GPU_SHAPE)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_constrained_outputs_valid_through_each_backend(gpu_model, backend):
    requests = _requests(seeded=backend == "triton")  # flashinfer ignores seeds
    engine = _engine(gpu_model, sampler_backend=backend)
    assert engine.executor.runner.graphs is not None
    _check(engine.generate(requests), requests)


def test_seeded_constrained_rows_equal_with_and_without_graphs_and_alone(gpu_model):
    """The constraints are compiled first: a request whose constraint still compiles is
    passed over, so the batches (and the bf16 logits computed in them) would otherwise
    depend on the compile pool's timing."""
    requests = _requests()
    results = {}
    for graphs in (True, False):
        engine = _engine(gpu_model, cuda_graphs=graphs, sampler_backend="triton")
        compile_first(engine, requests)
        outs = engine.generate(requests)
        _check(outs, requests)
        results[graphs] = [(o.output_token_ids, o.finish_reason) for o in outs]
        if graphs:
            alone = [engine.generate([requests[i]])[0] for i in (0, 1, 2)]
            assert [(o.output_token_ids, o.finish_reason) for o in alone] == results[True][:3]
        del engine
    assert results[True] == results[False]


def test_outputs_read_while_the_masks_fill_equal_the_launch_first_order(gpu_model):
    """The step order of ``Engine._launch`` with masks filled ahead (the previous step read
    back between the forward's launch and the sampler's, its finished rows freed after the
    sampler's launch) against launching every step first, on the GPU with graphs: the same
    tokens, finish reasons and logprobs. The constraints are compiled first: a request whose
    constraint still compiles is passed over, so otherwise the early steps' batches (and the
    bf16 logits computed in them) would depend on the compile pool's timing."""
    requests = _requests()
    results = {}
    for split in (True, False):
        engine = _engine(gpu_model, sampler_backend="triton")
        if not split:
            engine.structured.filling_after = lambda output: False
        compile_first(engine, requests)
        outs = engine.generate(requests)
        _check(outs, requests)
        results[split] = [(o.output_token_ids, o.finish_reason, o.logprobs) for o in outs]
        assert engine.sampler.state.active.sum() == 0  # every slot freed
        del engine
    assert results[True] == results[False]


def test_an_upload_queued_before_its_fill_starts_once_the_fill_is_marked():
    """The masks' upload a step queues while they still fill waits on the device for the
    fill's number (``MaskBuffers.filled``), and copies what the host wrote up to then."""
    import time

    from actors.engine.structured_masks import MaskBuffers

    buffers = MaskBuffers(torch.device("cuda"), 4, 3)
    masks = buffers.take()
    assert buffers.device_wait
    masks.host.fill_(1)
    try:
        total = buffers.hand_over(masks, 2, fill=5).sum()  # queued after the upload
        buffers.filled(4)  # an earlier fill: still waiting
        time.sleep(0.05)
        assert not masks.copied.query()
        masks.host[:2] = 9  # written before the mark: the copy takes it
        buffers.filled(5)
        masks.copied.synchronize()
        assert total.item() == 9 * 2 * 3
    finally:
        buffers.filled(1 << 30)  # never leave the device waiting
        torch.cuda.synchronize()
