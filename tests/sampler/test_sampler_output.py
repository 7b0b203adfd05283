"""SamplerOutput / AsyncOutput (CPU path: a plain copy; the CUDA path is exercised on GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import AsyncOutput, HostOutput, Sampler, SamplerOutput, SamplingParams


def test_async_output_copies_to_numpy():
    out = SamplerOutput(torch.tensor([3, 1]), torch.tensor([-0.5, float("nan")]),
                        torch.tensor([1, 0]), torch.tensor([[3, -1], [2, 4]]),
                        torch.tensor([[-0.5, float("-inf")], [-1.0, -2.0]]))
    pending = AsyncOutput(out)
    assert pending.is_ready()
    host = pending.get()
    assert isinstance(host, HostOutput)
    assert host.token_ids.tolist() == [3, 1] and host.token_ids.dtype == np.int64
    assert host.topk_ids.tolist() == [[3, -1], [2, 4]]
    out.token_ids[0] = 99  # the device tensors may be reused: the host copy is independent
    assert pending.get().token_ids.tolist() == [3, 1]
    assert pending.get() is host


def test_missing_fields_stay_none():
    host = AsyncOutput(SamplerOutput(torch.tensor([5]))).get()
    assert host.token_ids.tolist() == [5]
    assert host.logprobs is None and host.ranks is None and host.topk_ids is None


def test_sampler_output_roundtrip():
    s = Sampler(3, 30, device="cpu", eos_token_ids=[0])
    s.add_request(2, SamplingParams(logprobs=2, seed=4), [1], seed=4)
    out = s.sample(torch.randn(1, 30), [2])
    host = AsyncOutput(out).get()
    for name in ("token_ids", "logprobs", "ranks", "topk_ids", "topk_values"):
        assert np.array_equal(getattr(host, name), getattr(out, name).numpy())


@pytest.mark.gpu
def test_cuda_copy_uses_pinned_buffers_and_an_event():
    out = SamplerOutput(torch.arange(4, device="cuda"), torch.zeros(4, device="cuda"))
    pending = AsyncOutput(out)
    assert pending._event is not None
    assert all(t.is_pinned() for t in pending._host.values() if t is not None)
    assert pending.get().token_ids.tolist() == [0, 1, 2, 3]
