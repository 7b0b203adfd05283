"""The FlashInfer backend's dispatch on the CPU, with a fake ``flashinfer`` module.

The fake implements the four ``flashinfer.sampling`` functions the backend calls (0.6.4
signatures) in torch, checks their inputs as the real ones do (contiguous 2-D probs, per-row
parameter tensors, seed/offset int64 tensors on the device, normalised probabilities for the
samplers) and records every call. The device gate (CUDA, > 16 SMs) is patched open. The real
kernels are tested on the GPU (tests/sampler/test_gpu_sampler.py).
"""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest
import torch

import sampler.backends as backends
import sampler.flashinfer_pipeline as fip
from sampler import Sampler, SamplingParams, derive_seed, sample_logits
from sampler.ops.logprobs import compute_topk

from tests.sampler.helpers import chi2_pvalue
from tests.sampler.test_distribution import PARAMS, VOCAB, _expected, _row


_REAL_DEVICE_PROBLEM = backends._flashinfer_device_problem


class FakeSampling(types.ModuleType):
    """Torch stand-in for ``flashinfer.sampling`` that records its calls."""

    def __init__(self) -> None:
        super().__init__("flashinfer.sampling")
        self.calls: list[tuple[str, dict]] = []

    def softmax(self, logits, temperature=None, enable_pdl=None):
        assert logits.dim() == 2 and logits.is_contiguous(), "logits must be contiguous 2-D"
        t = 1.0 if temperature is None else temperature
        if isinstance(t, torch.Tensor):
            assert t.shape == (logits.shape[0],) and t.dtype == torch.float32
            t = t[:, None]
        self.calls.append(("softmax", {"temperature": temperature, "dtype": logits.dtype}))
        return torch.softmax(logits.float() / t, dim=-1)

    def top_k_renorm_probs(self, probs, top_k):
        assert probs.is_contiguous() and top_k.dtype == torch.int32
        assert top_k.shape == (probs.shape[0],)
        assert bool(((top_k >= 1) & (top_k <= probs.shape[1])).all()), "k in [1, vocab]"
        self.calls.append(("top_k_renorm_probs", {"top_k": top_k.clone()}))
        kth = probs.sort(dim=-1, descending=True).values.gather(
            1, (top_k.long() - 1)[:, None])
        kept = probs.masked_fill(probs < kth, 0.0)
        return kept / kept.sum(dim=-1, keepdim=True)

    def _sample(self, name, probs, top_p, deterministic, generator, seed, offset):
        assert probs.dim() == 2 and probs.is_contiguous() and probs.dtype == torch.float32
        assert generator is None and deterministic
        for t in (seed, offset):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1
            assert t.device == probs.device and t.shape[0] in (1, probs.shape[0])
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(probs.shape[0]),
                                   atol=1e-4, rtol=0)  # the samplers assume normalised rows
        self.calls.append((name, {"top_p": None if top_p is None else top_p.clone(),
                                  "seed": int(seed[0]), "offset": int(offset[0]),
                                  "probs": probs.clone()}))
        if top_p is not None:
            assert top_p.shape == (probs.shape[0],) and top_p.dtype == torch.float32
            # keep t iff the mass strictly more probable than t is < p
            above = (probs[:, None, :] > probs[:, :, None]).float() @ probs[:, :, None]
            probs = probs.masked_fill(above[..., 0] >= top_p[:, None], 0.0)
        g = torch.Generator().manual_seed((int(seed[0]) * 1_000_003 + int(offset[0])) % 2**63)
        out = torch.multinomial(probs, 1, generator=g)[:, 0].to(torch.int32)
        self.calls[-1][1]["out"] = out.clone()
        return out

    def top_p_sampling_from_probs(self, probs, top_p, indices=None, deterministic=True,
                                  generator=None, check_nan=False, seed=None, offset=None):
        assert indices is None
        return self._sample("top_p_sampling_from_probs", probs, top_p, deterministic,
                            generator, seed, offset)

    def sampling_from_probs(self, probs, indices=None, deterministic=True, generator=None,
                            check_nan=False, seed=None, offset=None):
        assert indices is None
        return self._sample("sampling_from_probs", probs, None, deterministic, generator,
                            seed, offset)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def fake(monkeypatch) -> FakeSampling:
    sampling = FakeSampling()
    package = types.ModuleType("flashinfer")
    package.__version__ = "0.6.4-fake"
    package.sampling = sampling
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", sampling)
    monkeypatch.setattr(backends, "_flashinfer_device_problem", lambda device: None)
    monkeypatch.setattr(backends, "_logged", set())
    monkeypatch.setattr(fip, "_logged_reasons", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the fallback is torch
    return sampling


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def _make(backend: str, vocab: int, requests: list[dict], **kw) -> Sampler:
    sampler = Sampler(len(requests), vocab, device="cpu", eos_token_ids=[0],
                      max_logprobs=vocab, backend=backend, **kw)
    for slot, req in enumerate(requests):
        sampler.add_request(slot, req["params"], req.get("prompt", [1, 2, 3]),
                            seed=req.get("seed", derive_seed(5, slot)),
                            output_token_ids=req.get("output", ()),
                            bad_words_token_ids=req.get("bad_words", ()))
    return sampler


def _reference_logprobs(logits, tokens, k):
    """Brute-force raw_logprobs outputs of ``tokens``: value, rank, top-k."""
    values = torch.log_softmax(logits.float(), dim=-1)
    sampled = values.gather(1, tokens[:, None])[:, 0]
    ranks = 1 + (values > sampled[:, None]).sum(dim=-1)
    ids, vals = compute_topk(values, k)
    return sampled, ranks, ids, vals


# ---------------------------------------------------------------------- choice and logging
def test_flashinfer_not_importable_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", None)
    with pytest.raises(ValueError, match=r"backend: 'flashinfer' is not available: "
                                         r"flashinfer is not importable.*raygen\[gpu\]"):
        Sampler(2, 16, device="cpu", eos_token_ids=[0], backend="flashinfer")


def test_flashinfer_needs_cuda(fake, monkeypatch):
    monkeypatch.setattr(backends, "_flashinfer_device_problem", _REAL_DEVICE_PROBLEM)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        Sampler(2, 16, device="cpu", eos_token_ids=[0], backend="flashinfer")


def test_auto_never_picks_flashinfer(fake):
    assert Sampler(2, 16, device="cpu", eos_token_ids=[0]).backend == "torch"
    assert fake.calls == []


def test_chosen_once_and_logged_once(fake, caplog):
    caplog.set_level(logging.INFO, logger="sampler")
    requests = [{"params": SamplingParams(temperature=0.8, top_p=0.9)} for _ in range(3)]
    samplers = [_make("flashinfer", 32, requests) for _ in range(2)]
    pipelines = set()
    for sampler in samplers:
        assert sampler.backend == "flashinfer"
        for step in range(3):
            sampler.sample(_logits(3, 32, step), [0, 1, 2])
            pipelines.add(id(sampler._run))
        assert sampler._run.num_flashinfer_steps == 3
    assert len(pipelines) == 2  # one pipeline object per Sampler, made at construction
    lines = [r.getMessage() for r in caplog.records if "sampler backend" in r.getMessage()]
    assert lines == ["sampler backend: flashinfer 0.6.4-fake on cpu (steps it cannot sample "
                     "run on torch)"]


# ---------------------------------------------------------------------- which rows go where
def test_rows_routing_and_output_contract(fake):
    vocab = 48
    requests = [
        {"params": SamplingParams(temperature=0.0, logprobs=3)},  # greedy
        {"params": SamplingParams(temperature=0.7, top_k=5, top_p=0.8, logprobs=0)},
        {"params": SamplingParams(temperature=1.3, min_p=0.05)},
        {"params": SamplingParams(temperature=0.0, repetition_penalty=1.5, seed=3),
         "prompt": [7, 8]},  # greedy with its own seed: still eligible (no noise)
        {"params": SamplingParams(temperature=1.0, top_k=vocab + 5, top_p=0.95,
                                  logprobs=2, logprobs_mode="raw_logits")},
        {"params": SamplingParams(temperature=0.9, top_k=-1, logprobs=1,
                                  logprobs_mode="temperature_logprobs")},
    ]
    logits = _logits(len(requests), vocab, 1).to(torch.bfloat16)
    fi = _make("flashinfer", vocab, requests)
    out = fi.sample(logits, list(range(len(requests))))
    assert fi._run.num_flashinfer_steps == 1 and fi._run.num_fallback_steps == 0
    assert fake.names() == ["softmax", "top_k_renorm_probs", "top_p_sampling_from_probs"]
    soft, topk, draw = (kw for _, kw in fake.calls)
    # per-row tensors: greedy rows hold T = 1, k = vocab (off), p = 1
    torch.testing.assert_close(soft["temperature"], torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.9]))
    assert topk["top_k"].tolist() == [vocab, 5, vocab, vocab, vocab, vocab]
    torch.testing.assert_close(draw["top_p"], torch.tensor([1.0, 0.8, 1.0, 1.0, 0.95, 1.0]))
    # the fake's draw is what random rows return; greedy rows take the argmax after
    # penalties (the torch backend's greedy token)
    greedy = torch.tensor([True, False, False, True, False, False])
    assert torch.equal(out.token_ids[~greedy], draw["out"].long()[~greedy])
    ref = _make("torch", vocab, requests).sample(logits, list(range(len(requests))))
    assert torch.equal(out.token_ids[greedy], ref.token_ids[greedy])
    # min-p dropped tokens of row 2 before the draw; the draw saw normalised probabilities
    probs = draw["probs"]
    row2 = torch.softmax(logits[2].float() / 1.3, dim=-1)
    assert torch.equal(probs[2] == 0, row2 < 0.05 * row2.max())
    # SamplerOutput contract
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    assert out.logprobs.dtype == torch.float32 and out.ranks.dtype == torch.int64
    assert out.topk_ids.shape == (6, 3) and out.topk_values.shape == (6, 3)
    asked = torch.tensor([True, True, False, False, True, True])
    assert torch.isnan(out.logprobs[~asked]).all() and (out.ranks[~asked] == 0).all()
    # logprobs mean what they mean on the torch backend, for the tokens drawn here
    value, rank, ids, vals = _reference_logprobs(logits, out.token_ids, 3)
    for r in (0, 1):
        assert out.logprobs[r] == value[r] and out.ranks[r] == rank[r]
    assert torch.equal(out.topk_ids[0], ids[0]) and torch.equal(out.topk_values[0], vals[0])
    assert (out.topk_ids[1] == -1).all()  # logprobs=0: no top-k entries
    raw = logits[4].float()
    assert out.logprobs[4] == raw[out.token_ids[4]]
    assert out.ranks[4] == 1 + (raw > raw[out.token_ids[4]]).sum()
    scaled = torch.log_softmax(logits[5].float() / torch.tensor(0.9), dim=-1)
    assert out.logprobs[5] == scaled[out.token_ids[5]]
    assert out.topk_ids[5, 1:].tolist() == [-1, -1]


def test_no_top_p_uses_sampling_from_probs_and_renormalises_after_min_p(fake):
    requests = [{"params": SamplingParams(temperature=1.0, min_p=0.1)} for _ in range(4)]
    fi = _make("flashinfer", 40, requests)
    fi.sample(_logits(4, 40, 3), [0, 1, 2, 3])
    assert fake.names() == ["softmax", "sampling_from_probs"]
    assert fake.calls[0][1]["temperature"] is None  # T = 1 everywhere: no temperature tensor


def test_all_greedy_step_never_calls_flashinfer(fake):
    requests = [{"params": SamplingParams(temperature=0.0, logprobs=2)} for _ in range(3)]
    logits = _logits(3, 30, 4)
    fi = _make("flashinfer", 30, requests)
    out = fi.sample(logits.clone(), [0, 1, 2])
    assert fake.calls == [] and fi._run.num_flashinfer_steps == 1
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_masks_and_penalties_run_before_the_draw(fake):
    vocab = 20
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 4, 5, 6], logit_bias={4: 50.0},
                            min_tokens=2, stop_token_ids=[5], frequency_penalty=2.0)
    requests = [{"params": params, "output": [6, 6]}, {"params": params}]
    fi = _make("flashinfer", vocab, requests)
    logits = torch.zeros(2, vocab)
    out = fi.sample(logits, [0, 1])
    probs = fake.calls[-1][1]["probs"]
    assert (probs[:, [0, 1, 2, 7]] == 0).all()  # not allowed
    assert probs[1, 5] == 0 and probs[0, 5] > 0  # stop id masked below min_tokens only
    assert probs[0, 6] < probs[1, 6]  # frequency penalty on the generated 6s
    assert out.token_ids.tolist() == [4, 4]  # the bias dominates


def test_non_contiguous_vocab_slice(fake):
    requests = [{"params": SamplingParams(temperature=0.8, top_k=3, logprobs=1)}] * 2
    padded = _logits(2, 64, 6)
    fi = _make("flashinfer", 50, requests)
    out = fi.sample(padded[:, :50], [0, 1])
    assert fake.calls[0][1]["dtype"] == torch.float32
    assert bool((out.token_ids < 50).all())
    value, rank, ids, _ = _reference_logprobs(padded[:, :50], out.token_ids, 1)
    assert torch.equal(out.logprobs, value) and torch.equal(out.topk_ids, ids)


def test_rng_offset_advances_and_seed_is_fixed(fake):
    requests = [{"params": SamplingParams(temperature=1.0, top_p=0.9)}] * 3
    fi = _make("flashinfer", 16, requests)
    for step in range(3):
        fi.sample(_logits(3, 16, step), [0, 1, 2])
    draws = [kw for name, kw in fake.calls if name == "top_p_sampling_from_probs"]
    assert len({kw["seed"] for kw in draws}) == 1
    assert [kw["offset"] for kw in draws] == [0, 96, 192]  # 32 per row, advanced on device
    other = _make("flashinfer", 16, requests)
    other.sample(_logits(3, 16, 0), [0, 1, 2])
    assert fake.calls[-1][1]["seed"] != draws[0]["seed"]  # each sampler its own stream


# ---------------------------------------------------------------------- fallback
INELIGIBLE = {
    "seeded random row": ({"params": SamplingParams(temperature=0.9, top_p=0.9, seed=11)},
                          {}, "a random row whose request set its own seed"),
    "processed logprobs": ({"params": SamplingParams(
        temperature=0.9, logprobs=2, logprobs_mode="processed_logprobs")}, {},
        "processed logprobs modes"),
    "processed logits": ({"params": SamplingParams(
        temperature=0.0, logprobs=0, logprobs_mode="processed_logits")}, {},
        "processed logprobs modes"),
    "whole vocab": ({"params": SamplingParams(temperature=0.9, logprobs=-1)}, {},
                    "whole-vocab logprobs"),
    "fp64 noise": ({"params": SamplingParams(temperature=0.9)}, {"noise_precision": "fp64"},
                   "fp64 noise"),
}


@pytest.mark.parametrize("case", sorted(INELIGIBLE))
def test_ineligible_steps_fall_back_to_the_host_chosen_backend(fake, caplog, case):
    caplog.set_level(logging.INFO, logger="sampler")
    odd, kw, reason = INELIGIBLE[case]
    vocab = 24
    plain = {"params": SamplingParams(temperature=0.7, top_k=4, logprobs=1)}
    requests = [plain, odd, plain]
    fi = _make("flashinfer", vocab, requests, **kw)
    ref = _make("torch", vocab, requests, **kw)
    for step in range(2):
        logits = _logits(3, vocab, step)
        got = fi.sample(logits.clone(), [0, 1, 2])
        want = ref.sample(logits.clone(), [0, 1, 2])
        for name in ("token_ids", "logprobs", "ranks", "topk_ids", "topk_values"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    assert fake.calls == []
    assert fi._run.num_fallback_steps == 2 and fi._run.num_flashinfer_steps == 0
    lines = [r.getMessage() for r in caplog.records if "flashinfer backend: steps" in
             r.getMessage()]
    assert lines == [f"sampler flashinfer backend: steps with {reason} run on torch"]


def test_fallback_is_decided_per_step(fake):
    vocab = 16
    fi = _make("flashinfer", vocab, [
        {"params": SamplingParams(temperature=1.0)},
        {"params": SamplingParams(temperature=1.0, seed=4)},
    ])
    fi.sample(_logits(1, vocab), [0])  # the seeded slot is not in this batch
    fi.sample(_logits(2, vocab), [0, 1])
    assert (fi._run.num_flashinfer_steps, fi._run.num_fallback_steps) == (1, 1)


# ---------------------------------------------------------------------- stateless + statistics
def test_sample_logits_backend_flashinfer(fake):
    logits = _logits(3, 20, 9)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=2),
              SamplingParams(temperature=1.0, logprobs=0)]
    out = sample_logits(logits, params, backend="flashinfer")
    assert fake.names() == ["softmax", "top_k_renorm_probs", "sampling_from_probs"]
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[1] in logits[1].topk(2).indices
    assert torch.equal(logits, _logits(3, 20, 9))  # the stateless entry never writes


def test_draws_follow_the_oracle_distribution(fake):
    """Our steps around the (exact, fake) FlashInfer calls give the oracle's distribution:
    temperature, min-p on probabilities, top-k then top-p on the renormalised rest."""
    slots, steps = 1000, 20
    params = PARAMS.replace(seed=-1)  # unseeded: eligible
    sampler = Sampler(slots, VOCAB, device="cpu", eos_token_ids=[0], backend="flashinfer")
    sampler._run._seed.fill_(2024)  # a fixed Philox stream: the test's outcome is reproducible
    for slot in range(slots):
        sampler.add_request(slot, params, [1, 2, 3], seed=derive_seed(99, slot))
    counts = np.zeros(VOCAB, dtype=np.int64)
    batch = _row().expand(slots, VOCAB)
    for _ in range(steps):
        out = sampler.sample(batch.clone(), list(range(slots)))
        counts += np.bincount(out.token_ids.numpy(), minlength=VOCAB)
    assert sampler._run.num_flashinfer_steps == steps
    kept, probs = _expected(PARAMS)
    assert counts[~kept].sum() == 0
    p = chi2_pvalue(counts[kept], probs[kept] * counts.sum())
    assert p > 1e-3, f"chi-square p = {p}"
