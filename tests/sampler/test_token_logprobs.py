"""compute_token_logprobs: raw and temperature logprobs of one token per row, both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams
from sampler.backends import available_backends
from sampler.ops.token_logprobs import compute_token_logprobs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = "triton" in available_backends(DEVICE)


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).to(DEVICE)
    logits[0, : vocab // 3] = float("-inf")  # masked entries (e.g. vocab padding)
    tokens = torch.randint(vocab // 3, vocab, (rows,), generator=gen).to(DEVICE)
    temps = torch.empty(rows).uniform_(0.3, 2.0, generator=gen).to(DEVICE)
    temps[-1] = 1.0
    return logits, tokens, temps


def _definition(logits, tokens, temps):
    z = logits.double()
    raw = torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0]
    temp = torch.log_softmax(z / temps.double()[:, None], -1).gather(1, tokens[:, None])[:, 0]
    return raw, temp


BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,vocab", [(1, 111), (7, 1000), (3, 4099)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_the_definition(backend, rows, vocab, dtype):
    logits, tokens, temps = _case(rows, vocab, dtype, seed=rows * vocab)
    before = logits.clone()
    raw, temp = compute_token_logprobs(logits, tokens, temps, backend=backend)
    want_raw, want_temp = _definition(logits, tokens, temps)
    assert raw.dtype == temp.dtype == torch.float32
    torch.testing.assert_close(raw.double(), want_raw, rtol=0, atol=2e-5)
    torch.testing.assert_close(temp.double(), want_temp, rtol=0, atol=2e-5)
    assert torch.equal(logits, before)  # never modified


def test_torch_backend_equals_the_samplers_modes_bit_for_bit():
    """raw_logprobs / temperature_logprobs here are exactly the torch pipeline's mode values."""
    rng = np.random.default_rng(3)
    vocab, rows = 300, 5
    logits = torch.from_numpy(rng.normal(0, 3, (rows, vocab)).astype(np.float32))
    temps = [0.0, 0.5, 1.0, 1.7, 0.01]
    values = {}
    for mode in ("raw_logprobs", "temperature_logprobs"):
        sampler = Sampler(8, vocab, device="cpu", eos_token_ids=[0], backend="torch")
        for slot, t in enumerate(temps):
            sampler.add_request(slot, SamplingParams(temperature=t, top_k=20, logprobs=0,
                                                     logprobs_mode=mode), [1], seed=slot)
        out = sampler.sample(logits.clone(), list(range(rows)))
        values[mode] = (out.token_ids, out.logprobs)
    tokens = values["raw_logprobs"][0]
    assert torch.equal(tokens, values["temperature_logprobs"][0])
    t = torch.tensor([x or 1.0 for x in temps])  # greedy rows: T = 1
    raw, temp = compute_token_logprobs(logits, tokens, t)
    assert torch.equal(raw, values["raw_logprobs"][1])
    assert torch.equal(temp, values["temperature_logprobs"][1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_equals_the_fused_kernels_modes():
    """Same tiles and accumulators as the fused kernel: its raw/temperature modes, bit for
    bit."""
    rng = np.random.default_rng(5)
    vocab, rows = 257, 4
    logits = torch.from_numpy(rng.normal(0, 3, (rows, vocab)).astype(np.float32)).to(DEVICE)
    temps = [0.0, 0.6, 1.0, 1.3]
    got = {}
    for mode in ("raw_logprobs", "temperature_logprobs"):
        sampler = Sampler(4, vocab, device=DEVICE, eos_token_ids=[0], backend="triton")
        for slot, t in enumerate(temps):
            sampler.add_request(slot, SamplingParams(temperature=t, logprobs=0,
                                                     logprobs_mode=mode), [1], seed=slot)
        out = sampler.sample(logits, list(range(rows)))
        got[mode] = (out.token_ids, out.logprobs)
    tokens = got["raw_logprobs"][0]
    t = torch.tensor([x or 1.0 for x in temps], device=DEVICE)
    raw, temp = compute_token_logprobs(logits, tokens, t, backend="triton")
    # the same accumulators as the fused kernel's one-pass statistics (bit for bit)
    torch.testing.assert_close(raw, got["raw_logprobs"][1], rtol=0, atol=0.0)
    torch.testing.assert_close(temp, got["temperature_logprobs"][1], rtol=0, atol=0.0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_reads_a_vocab_slice_of_padded_logits():
    padded = torch.randn(3, 140, device=DEVICE)
    tokens = torch.tensor([0, 50, 127], device=DEVICE)
    temps = torch.tensor([1.0, 0.7, 2.0], device=DEVICE)
    want = compute_token_logprobs(padded[:, :128], tokens, temps)
    got = compute_token_logprobs(padded[:, :128], tokens, temps, backend="triton")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6)


def test_bad_arguments_raise_value_errors():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="token_ids"):
        compute_token_logprobs(logits, torch.zeros(3, dtype=torch.long), torch.ones(2))
    with pytest.raises(ValueError, match="temperature"):
        compute_token_logprobs(logits, torch.zeros(2, dtype=torch.long), torch.ones(1))
    with pytest.raises(ValueError, match="logits"):
        compute_token_logprobs(torch.zeros(5), torch.zeros(5, dtype=torch.long), torch.ones(5))
    with pytest.raises(ValueError, match="backend"):
        compute_token_logprobs(logits, torch.zeros(2, dtype=torch.long), torch.ones(2),
                               backend="cuda")
