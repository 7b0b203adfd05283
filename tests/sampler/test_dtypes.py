"""bf16/fp16 input with float32 math, the pristine raw snapshot, non-contiguous logits."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sampler import LOGPROBS_MODES, Sampler, SamplingParams, sample_logits

from tests.sampler.helpers import assert_same_output, oracle_rows, random_logits


def _params(rows, vocab, seed):
    rng = random.Random(seed)
    return [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5, vocab // 3]),
            top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.4]), logit_bias={1: 0.5},
            logprobs=rng.choice([None, 0, 4]), logprobs_mode=LOGPROBS_MODES[r % 5],
            seed=rng.randrange(2**63),
        )
        for r in range(rows)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(7, 111), (7, 32000), (1, 151936)])
def test_half_input_equals_float32_of_the_same_values(dtype, rows, vocab):
    half = random_logits(rows, vocab, rows + vocab, ties=True).to(dtype)
    params = _params(rows, vocab, vocab)
    prompts = [[3, 4, 5]] * rows
    before = half.clone()
    out_half = sample_logits(half, params, prompt_token_ids=prompts)
    out_fp32 = sample_logits(half.float(), params, prompt_token_ids=prompts)
    assert_same_output(out_half, out_fp32)
    assert torch.equal(half.view(torch.int16), before.view(torch.int16))  # input untouched
    s = Sampler(rows, vocab, device="cpu", eos_token_ids=[0], max_logprobs=20)
    for r, p in enumerate(params):
        s.add_request(r, p, prompts[r], seed=p.seed)
    assert_same_output(s.sample(half, list(range(rows))), out_fp32)
    assert torch.equal(half.view(torch.int16), before.view(torch.int16))
    oracle = oracle_rows(half, params, prompts=prompts)
    assert out_half.token_ids.tolist() == [res.token_id for res in oracle]


def test_raw_snapshot_survives_in_place_steps():
    vocab = 200
    logits = random_logits(3, vocab, 8)
    pristine = logits.clone()
    mutating = dict(temperature=0.5, top_k=3, min_p=0.1, repetition_penalty=2.0,
                    allowed_token_ids=list(range(0, vocab, 2)), logprobs=-1, seed=1)
    params = [SamplingParams(**mutating, logprobs_mode=m)
              for m in ("raw_logits", "raw_logprobs", "temperature_logprobs")]
    s = Sampler(3, vocab, device="cpu", eos_token_ids=[0], max_logprobs=vocab)
    for r, p in enumerate(params):
        s.add_request(r, p, [2, 4], seed=1)
    out = s.sample(logits, [0, 1, 2])  # float32: logits is the working buffer
    assert torch.isinf(logits).any(), "the float32 input was not used in place"
    wants = [pristine, torch.log_softmax(pristine, -1), torch.log_softmax(pristine / 0.5, -1)]
    for r, want in enumerate(wants):
        got = torch.empty(vocab)
        got[out.topk_ids[r]] = out.topk_values[r]
        assert torch.equal(got, want[r])


def test_stateless_call_never_modifies_float32_input():
    logits = random_logits(2, 100, 2)
    before = logits.clone()
    sample_logits(logits, [SamplingParams(top_k=2, seed=1, logprobs=1,
                                          logprobs_mode="processed_logits")] * 2)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_sliced_logits(dtype):
    rows, vocab, padded = 7, 1000, 1024
    full = random_logits(rows, padded, 4).to(dtype)
    full[:, vocab:] = 1e4  # padding columns would win if they were read
    sliced = full[:, :vocab]
    assert not sliced.is_contiguous()
    params = _params(rows, vocab, 4)
    contiguous = sliced.contiguous()
    want = sample_logits(contiguous, params)
    assert_same_output(sample_logits(sliced, params), want)
    s = Sampler(8, vocab, device="cpu", eos_token_ids=[0], max_logprobs=20)
    for r, p in enumerate(params):
        s.add_request(7 - r, p, [], seed=p.seed)
    assert_same_output(s.sample(sliced, [7 - r for r in range(rows)]), want)
    assert (full[:, vocab:] == 1e4).all()  # in-place steps stayed inside the slice


def test_all_greedy_half_batch_needs_no_float32_copy(monkeypatch):
    half = random_logits(5, 300, 9, ties=True).to(torch.bfloat16)
    want = half.float().argmax(-1)

    def no_copy(self, *args, **kwargs):
        raise AssertionError("float32 copy made")

    monkeypatch.setattr(torch.Tensor, "float", no_copy)
    out = sample_logits(half, [SamplingParams(temperature=0.0, logprobs=2)] * 5)
    monkeypatch.undo()
    assert torch.equal(out.token_ids, want)
    assert torch.equal(out.logprobs, torch.log_softmax(half.float(), -1).gather(1, want[:, None])[:, 0])


@pytest.mark.parametrize("rows,vocab", [(7, 111), (3, 32000)])
def test_half_and_float32_give_the_same_kept_sets(rows, vocab):
    half = random_logits(rows, vocab, 31, ties=True).to(torch.bfloat16)
    params = [p.replace(logprobs=-1, logprobs_mode="processed_logits")
              for p in _params(rows, vocab, 31)]
    params[0] = params[0].replace(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05)
    outs = [sample_logits(x, params, max_logprobs=vocab) for x in (half, half.float())]
    processed = []
    for out in outs:
        full = torch.empty(rows, vocab)
        full.scatter_(1, out.topk_ids, out.topk_values)
        processed.append(full)
    assert torch.equal(torch.isfinite(processed[0]), torch.isfinite(processed[1]))
    assert torch.equal(processed[0], processed[1])
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    assert not torch.isfinite(processed[0]).all()  # the filters did drop tokens


class _LogitsCopies(TorchDispatchMode):
    """Counts the float32 copies of a logits tensor made while active: ``_to_copy`` /
    ``clone`` of it (or of such a copy), or ``copy_`` from it, into a float32 tensor of at
    least rows * vocab elements. Ops that compute something new from the logits
    (log_softmax, noise, sort, ``torch.where``) are not copies; the copy torch's
    ``log_softmax(x, dtype=float32)`` makes of a bf16 ``x`` before its kernel is."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.storages = {logits.untyped_storage().data_ptr()}
        self.size = logits.numel()
        self.copies: list[str] = []

    def _of_logits(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in ("aten._to_copy", "aten.clone", "aten.copy"):
            src, dst = args[0], out
        elif name == "aten.copy_":
            src, dst = args[1], args[0]
        else:
            return out
        if (self._of_logits(src) and isinstance(dst, torch.Tensor)
                and dst.dtype == torch.float32 and dst.numel() >= self.size
                and not self._of_logits(dst)):
            self.copies.append(name)
            self.storages.add(dst.untyped_storage().data_ptr())
        return out


# mode -> float32 copies of the logits allowed beyond the bf16 working buffer. Only a
# raw_logits row needs raw values preserved against the in-place steps (docs/sampler.md §2.1:
# "the values it needs ... fp32 values for raw_logits"; the raw_logprobs and
# temperature_logprobs values are new tensors, not copies of the logits).
EXTRA_COPIES = {None: 0, "raw_logprobs": 0, "temperature_logprobs": 0, "processed_logprobs": 0,
                "processed_logits": 0, "raw_logits": 1}


@pytest.mark.parametrize("mode", list(EXTRA_COPIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_batch_makes_no_float32_copy_beyond_the_working_buffer(dtype, mode):
    """A random-sampling batch (temperature, top-k, top-p, min-p: in-place steps) through
    the Sampler: bf16 logits get exactly one float32 copy, the working buffer the fp32 math
    runs in; float32 logits are the working buffer themselves (none). A second copy only for
    raw_logits rows, whose raw values must survive the in-place steps."""
    rows, vocab = 7, 32000
    logits = random_logits(rows, vocab, 12, dtype=dtype)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seed=r,
                             logprobs=None if mode is None else 2,
                             logprobs_mode=mode or "raw_logprobs") for r in range(rows)]
    want = sample_logits(logits, params)
    s = Sampler(rows, vocab, device="cpu", eos_token_ids=[0], max_logprobs=20)
    for r, p in enumerate(params):
        s.add_request(r, p, [1, 2], seed=p.seed)
    with _LogitsCopies(logits) as spy:
        out = s.sample(logits, list(range(rows)))
    working = 1 if dtype == torch.bfloat16 else 0
    assert len(spy.copies) == working + EXTRA_COPIES[mode], spy.copies
    assert_same_output(out, want)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "temperature_logprobs"])
def test_random_half_batch_without_in_place_steps_has_one_float32_copy(mode):
    """T = 1 and no filter: nothing mutates the bf16 working copy, so even raw_logits rows
    read their values from it (one float32 copy of the logits in all)."""
    rows, vocab = 3, 32000
    logits = random_logits(rows, vocab, 13, dtype=torch.bfloat16)
    params = [SamplingParams(seed=r, logprobs=1, logprobs_mode=mode) for r in range(rows)]
    want = sample_logits(logits, params)
    s = Sampler(rows, vocab, device="cpu", eos_token_ids=[0])
    for r, p in enumerate(params):
        s.add_request(r, p, [], seed=p.seed)
    with _LogitsCopies(logits) as spy:
        out = s.sample(logits, list(range(rows)))
    assert len(spy.copies) == 1, spy.copies
    assert_same_output(out, want)
