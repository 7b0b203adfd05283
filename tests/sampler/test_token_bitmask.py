"""Grammar masks in the sampler: the packed per-row bitmask op, and Sampler.sample with masks
on some rows (raw logprobs before the mask, processed ones after)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams
from sampler.grammar_mask import StepBitmask
from sampler.ops.token_bitmask import (apply_token_bitmask, pack_token_bitmask,
                                       unpack_token_bitmask)

from tests.sampler.helpers import random_logits


def random_allowed(rows: int, vocab: int, seed: int, density: float = 0.05) -> np.ndarray:
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, vocab)) < density
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True  # never an empty row
    return allowed


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_pack_is_the_inverse_of_unpack(vocab):
    allowed = random_allowed(3, vocab, vocab, density=0.5)
    bits = pack_token_bitmask(allowed)
    assert bits.dtype == torch.int32 and bits.shape == (3, (vocab + 31) // 32)
    assert torch.equal(unpack_token_bitmask(bits, vocab), torch.from_numpy(allowed))
    if vocab >= 32:  # token 31 is the word's sign bit
        top = np.zeros((1, vocab), dtype=bool)
        top[0, 31] = True
        assert pack_token_bitmask(top)[0, 0].item() == -2**31


@pytest.mark.parametrize("rows,vocab", [(1, 31), (7, 111), (5, 1000), (3, 32000)])
def test_apply_token_bitmask_matches_a_loop(rows, vocab):
    logits = random_logits(rows, vocab, 1)
    mask_rows = np.arange(0, rows, 2)
    allowed = random_allowed(len(mask_rows), vocab, rows)
    x = logits.clone()
    apply_token_bitmask(x, pack_token_bitmask(allowed), torch.from_numpy(mask_rows))
    want = logits.clone()
    for j, r in enumerate(mask_rows):
        for t in range(vocab):
            if not allowed[j, t]:
                want[r, t] = float("-inf")
    assert torch.equal(x, want)


def test_tokens_past_the_mask_words_are_masked():
    bits = torch.tensor([[-1]], dtype=torch.int32)  # 32 tokens allowed
    assert unpack_token_bitmask(bits, 40)[0].tolist() == [True] * 32 + [False] * 8
    x = torch.zeros(1, 40)
    apply_token_bitmask(x, bits, torch.tensor([0]))
    assert torch.isinf(x[0, 32:]).all() and torch.isfinite(x[0, :32]).all()


def _sampler(params, vocab, backend="torch"):
    s = Sampler(len(params), vocab, device="cpu", eos_token_ids=[0], backend=backend)
    for slot, p in enumerate(params):
        s.add_request(slot, p, [1, 2], seed=p.seed or 0)
    return s


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampler_masks_only_the_constrained_rows(backend):
    vocab, rows = 1000, 6
    params = [SamplingParams(temperature=0.0 if r % 3 == 0 else 1.0, top_k=20 if r == 4 else 0,
                             seed=r, logprobs=3) for r in range(rows)]
    logits = random_logits(rows, vocab, 2)
    mask_rows = np.array([1, 3, 4])
    allowed = random_allowed(len(mask_rows), vocab, 9)
    plain = _sampler(params, vocab, backend).sample(logits.clone(), list(range(rows)))
    masked_s = _sampler(params, vocab, backend)
    mask = StepBitmask.build(pack_token_bitmask(allowed), mask_rows, rows, torch.device("cpu"))
    out = masked_s.sample(logits.clone(), list(range(rows)), token_bitmask=mask)
    for r in range(rows):
        if r in mask_rows:
            j = int(np.flatnonzero(mask_rows == r)[0])
            assert allowed[j, out.token_ids[r].item()]
        else:  # unconstrained rows: the same draw as without masks
            assert out.token_ids[r] == plain.token_ids[r]
            assert out.logprobs[r].item() == pytest.approx(plain.logprobs[r].item(), abs=1e-5)
    # raw logprobs are the model's: the sampled token's value from the unmasked logits
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw[torch.arange(rows), out.token_ids], atol=1e-6)
    assert masked_s.state.token_bitmask is None  # the masks belong to that step only


def test_processed_logprobs_are_taken_after_the_mask():
    vocab = 300
    params = [SamplingParams(temperature=1.0, seed=3, logprobs=2,
                             logprobs_mode="processed_logprobs")]
    logits = random_logits(1, vocab, 4)
    allowed = np.zeros((1, vocab), dtype=bool)
    allowed[0, [5, 17, 200]] = True
    s = _sampler(params, vocab)
    mask = StepBitmask.build(pack_token_bitmask(allowed), np.array([0]), 1, torch.device("cpu"))
    out = s.sample(logits.clone(), [0], token_bitmask=mask)
    kept = logits[0, [5, 17, 200]]
    want = torch.log_softmax(kept, dim=-1)
    tok = out.token_ids[0].item()
    assert tok in (5, 17, 200)
    assert out.logprobs[0].item() == pytest.approx(want[[5, 17, 200].index(tok)].item(),
                                                   abs=1e-6)
    assert set(out.topk_ids[0].tolist()) <= {5, 17, 200}


def test_a_bitmask_of_the_wrong_shape_is_refused():
    s = _sampler([SamplingParams(seed=1)], 100)
    bad = StepBitmask(torch.zeros(1, 3, dtype=torch.int32), torch.tensor([0]),
                      torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"token_bitmask\.bits"):
        s.sample(torch.zeros(1, 100), [0], token_bitmask=bad)


@pytest.mark.parametrize("rows,vocab,block", [(1, 31, 64), (7, 111, 64), (5, 1000, 256),
                                              (3, 4133, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_bitmask_kernel_matches_torch(rows, vocab, block, dtype):
    from sampler.kernels.token_bitmask_kernel import apply_token_bitmask_triton

    logits = random_logits(rows, vocab, 5)
    mask_rows = torch.tensor([r for r in range(rows) if r % 3 != 1], dtype=torch.int64)
    bits = pack_token_bitmask(random_allowed(len(mask_rows), vocab, vocab))
    want = logits.clone()
    apply_token_bitmask(want, bits, mask_rows)
    got = logits.to(dtype)
    apply_token_bitmask_triton(got, bits, mask_rows, block=block)
    assert torch.equal(got, want.to(dtype))
    # a strided vocab slice of a padded tensor: the padding is never written
    padded = torch.cat([logits, torch.full((rows, 13), 7.0)], dim=1).to(dtype)
    apply_token_bitmask_triton(padded[:, :vocab], bits, mask_rows, block=block)
    assert torch.equal(padded[:, :vocab], want.to(dtype)) and (padded[:, vocab:] == 7.0).all()


MIXES = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
         dict(temperature=0.9, top_p=0.8), dict(temperature=1.2, min_p=0.05, top_k=40),
         dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=1.0, logprobs=2)]


@pytest.mark.parametrize("vocab", [111, 2000])
@pytest.mark.parametrize("logprobs", [True, False])
def test_triton_backend_with_masks_equals_torch(vocab, logprobs, monkeypatch):
    """Masked and unmasked rows of every sampling kind: the Triton kernels (not the torch
    fallback) draw the tokens the torch path draws (counter-based noise), with the same raw
    logprobs. Without logprobs in the step the masked tokens are first written -inf into the
    logits (one pass) and the kernels read no mask; with them the kernels mask their tiles
    and the logits are left as they were."""
    import sampler.kernels.launcher as kp

    def no_fallback(*args, **kwargs):
        raise AssertionError("the Triton backend fell back to the torch path")

    monkeypatch.setattr(kp, "run_pipeline", no_fallback)
    passes = []
    pre_mask = kp.apply_token_bitmask_triton
    monkeypatch.setattr(kp, "apply_token_bitmask_triton",
                        lambda *args: passes.append(1) or pre_mask(*args))
    mixes = MIXES if logprobs else [m for m in MIXES if "logprobs" not in m]
    rows = 2 * len(mixes)
    params = [SamplingParams(seed=40 + r, **mixes[r % len(mixes)]) for r in range(rows)]
    logits = random_logits(rows, vocab, 6)
    mask_rows = np.array([r for r in range(rows) if r % 2 == 0])
    allowed = random_allowed(len(mask_rows), vocab, 3, density=0.2)
    outs, given = {}, {}
    for backend in ("torch", "triton"):
        s = _sampler(params, vocab, backend)
        mask = StepBitmask.build(pack_token_bitmask(allowed), mask_rows, rows, torch.device("cpu"))
        given[backend] = logits.clone()
        outs[backend] = s.sample(given[backend], list(range(rows)), token_bitmask=mask)
    assert passes == ([] if logprobs else [1])
    masked = logits.clone()
    apply_token_bitmask(masked, pack_token_bitmask(allowed), torch.from_numpy(mask_rows))
    assert torch.equal(given["triton"], logits if logprobs else masked)
    assert torch.equal(outs["torch"].token_ids, outs["triton"].token_ids)
    if logprobs:
        asked = [r for r in range(rows) if params[r].logprobs is not None]
        assert torch.allclose(outs["torch"].logprobs[asked], outs["triton"].logprobs[asked],
                              atol=1e-5)
    for j, r in enumerate(mask_rows):
        assert allowed[j, outs["triton"].token_ids[r].item()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,logprobs", [("triton", True), ("triton", False),
                                              ("flashinfer", True)])
def test_gpu_backends_respect_masks_on_bf16_logits(backend, logprobs):
    """151,936-wide bf16 logits, 64 rows (half masked): every masked row samples an allowed
    token; the Triton backend draws the torch path's tokens (without logprobs in the step,
    after writing -inf over the masked tokens first)."""
    dev = torch.device("cuda")
    vocab, rows = 151936, 64
    mixes = MIXES if logprobs else [m for m in MIXES if "logprobs" not in m]
    params = [SamplingParams(**mixes[r % len(mixes)]) if backend == "flashinfer" else
              SamplingParams(seed=7 + r, **mixes[r % len(mixes)]) for r in range(rows)]
    logits = random_logits(rows, vocab, 8).to(dev, torch.bfloat16)
    mask_rows = np.arange(0, rows, 2)
    allowed = random_allowed(len(mask_rows), vocab, 4, density=0.001)
    outs = {}
    for name in ("torch", backend):
        s = Sampler(rows, vocab, device=dev, eos_token_ids=[0], backend=name)
        for slot, p in enumerate(params):
            s.add_request(slot, p, [1, 2], seed=p.seed or 0)
        mask = StepBitmask.build(pack_token_bitmask(allowed).to(dev), mask_rows, rows, dev)
        outs[name] = s.sample(logits, list(range(rows)), token_bitmask=mask).token_ids.cpu()
    for j, r in enumerate(mask_rows):
        assert allowed[j, outs[backend][r].item()]
    if backend == "triton":
        assert torch.equal(outs["torch"], outs["triton"])


def test_triton_all_greedy_step_with_masks_equals_torch():
    """An all-greedy step (the greedy split's kernels on the Triton backend)."""
    vocab, rows = 333, 5
    params = [SamplingParams(temperature=0.0, seed=r) for r in range(rows)]
    logits = random_logits(rows, vocab, 9)
    mask_rows = np.array([0, 3, 4])
    allowed = random_allowed(len(mask_rows), vocab, 8, density=0.1)
    want = logits.clone()
    apply_token_bitmask(want, pack_token_bitmask(allowed), torch.from_numpy(mask_rows))
    s = _sampler(params, vocab, "triton")
    mask = StepBitmask.build(pack_token_bitmask(allowed), mask_rows, rows, torch.device("cpu"))
    out = s.sample(logits.clone(), list(range(rows)), token_bitmask=mask)
    assert out.token_ids.tolist() == want.argmax(dim=-1).tolist()
