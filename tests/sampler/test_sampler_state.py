"""The stateful Sampler over a randomised persistent batch equals sample_logits on the same
inputs: requests added, removed, preempted and re-admitted, slots reused, every feature on."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from sampler import LOGPROBS_MODES, AsyncOutput, Sampler, SamplingParams, derive_seed, sample_logits
from sampler.sampler_output import SamplerOutput

from tests.sampler.helpers import assert_same_output

EOS = [0, 1]


@dataclass
class Live:
    params: SamplingParams
    prompt: list[int]
    sample_index: int
    bad_words: list[list[int]]
    output: list[int] = field(default_factory=list)


def _random_request(rng: random.Random, vocab: int, serial: int) -> Live:
    bad = []
    if rng.random() < 0.4:
        bad = [[rng.randrange(vocab) for _ in range(rng.choice([1, 2, 3]))] for _ in range(2)]
        bad.append([7, 8])  # a prefix that the planted logits make likely
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.4]),
        top_k=rng.choice([0, 0, 1, 5, 40]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4]),
        presence_penalty=rng.choice([0.0, 0.0, -0.3]),
        min_tokens=rng.choice([0, 0, 3, 8]),
        stop_token_ids=rng.choice([[], [5], [5, 6]]),
        logprobs=rng.choice([None, None, 0, 2, 5, 20]),
        logprobs_mode=rng.choice(LOGPROBS_MODES),
        logit_bias=rng.choice([None, {7: 2.0, 8: 1.5, 3: -1.0}]),
        allowed_token_ids=rng.choice([None, None, None, list(range(0, vocab, 3))]),
        seed=derive_seed(11, serial),
        max_tokens=None,
    )
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
    return Live(params, prompt, rng.randrange(3), bad)


def _compare_widths(got: SamplerOutput, want: SamplerOutput) -> None:
    """Equal, except that ``got`` may carry extra top-k columns of padding."""
    if want.topk_ids is not None and got.topk_ids is not None:
        k = want.topk_ids.shape[1]
        assert (got.topk_ids[:, k:] == -1).all() and torch.isneginf(got.topk_values[:, k:]).all()
        got = SamplerOutput(got.token_ids, got.logprobs, got.ranks, got.topk_ids[:, :k],
                            got.topk_values[:, :k])
    elif want.topk_ids is None and got.topk_ids is not None:
        assert (got.topk_ids == -1).all()
        got = SamplerOutput(got.token_ids, got.logprobs, got.ranks)
    if want.logprobs is None and got.logprobs is not None:
        assert got.logprobs.isnan().all()
        got = SamplerOutput(got.token_ids)
    assert_same_output(got, want)


@pytest.mark.parametrize("vocab,host_slots", [(300, True), (4099, True), (300, False)])
def test_fifty_steps_equal_stateless(vocab, host_slots, monkeypatch):
    rng = random.Random(vocab + host_slots)
    max_num_seqs = 12
    sampler = Sampler(max_num_seqs, vocab, device="cpu", eos_token_ids=EOS)
    if not host_slots:  # as with slots on a GPU: predicates over every active slot
        real = Sampler._index
        monkeypatch.setattr(Sampler, "_index",
                            lambda self, slots, rows, *rest: (real(self, slots, rows)[0], None))
    live: dict[int, Live] = {}
    serial = 0
    seen_reuse = seen_readmit = seen_batched = 0
    for step in range(50):
        for slot in list(live):
            if rng.random() < 0.12:  # finished
                sampler.remove_request(slot)
                del live[slot]
            elif rng.random() < 0.05:  # preempted, re-admitted with its outputs
                req = live[slot]
                if req.output and rng.random() < 0.5:
                    req.output[-1] = -1  # the last token still in flight
                sampler.remove_request(slot)
                sampler.add_request(slot, req.params, req.prompt, seed=req.params.seed,
                                    sample_index=req.sample_index, output_token_ids=req.output,
                                    bad_words_token_ids=req.bad_words)
                seen_readmit += 1
        free = [s for s in range(max_num_seqs) if s not in live]
        admitted = rng.sample(free, k=min(len(free), rng.randrange(0, 4)))
        batched = rng.random() < 0.5  # one add_requests for the step's admissions
        for slot in admitted:
            serial += 1
            req = _random_request(rng, vocab, serial)
            if not batched:
                sampler.add_request(slot, req.params, req.prompt, seed=req.params.seed,
                                    sample_index=req.sample_index,
                                    bad_words_token_ids=req.bad_words)
            seen_reuse += step > 0 and slot < max_num_seqs
            live[slot] = req
        if batched and admitted:
            reqs = [live[slot] for slot in admitted]
            sampler.add_requests(
                admitted, [sampler.prepare(r.params, r.bad_words) for r in reqs],
                [np.array(r.prompt, dtype=rng.choice([np.int64, np.int32])) for r in reqs],
                seeds=[r.params.seed for r in reqs],
                sample_indices=[r.sample_index for r in reqs],
                output_token_ids=[[] for _ in reqs])
            seen_batched += 1
        scheduled = [s for s in live if rng.random() < 0.85]
        rng.shuffle(scheduled)
        if not scheduled:
            continue
        dtype = rng.choice([torch.float32, torch.bfloat16])
        g = torch.Generator().manual_seed(step)
        logits = (torch.randn(len(scheduled), vocab, generator=g) * 2).to(dtype)
        logits[:, [7, 8, 0, 5]] += 3.0  # bad-word prefix, stop ids and EOS are frequent
        reqs = [live[s] for s in scheduled]
        want = sample_logits(
            logits, [r.params for r in reqs],
            prompt_token_ids=[r.prompt for r in reqs],
            output_token_ids=[r.output for r in reqs],
            sample_indices=[r.sample_index for r in reqs],
            eos_token_ids=EOS,
            bad_words_token_ids=[r.bad_words for r in reqs],
            max_logprobs=20,
        )
        out = sampler.sample(logits.clone(), scheduled)
        host = AsyncOutput(out).get()
        assert np.array_equal(host.token_ids, out.token_ids.numpy())
        if host_slots:
            assert_same_output(out, want)
        else:
            _compare_widths(out, want)
        for r, token in zip(reqs, out.token_ids.tolist()):
            r.output.append(token)
    assert serial > 20 and seen_reuse and seen_readmit and seen_batched
    # the device-side counts equal the history of every slot with penalties
    for slot, req in live.items():
        if req.params.needs_penalties:
            known = [t for t in req.output if t >= 0]
            assert sampler.state.output_counts[slot].tolist() == np.bincount(
                known, minlength=vocab).tolist()


def _host_tables(sampler: Sampler) -> dict:
    st = sampler.state
    tables = {name: getattr(st, name).copy() for name in (
        "active", "pos_host", "has_penalties", "has_bad_words", "has_bias", "has_seed",
        "fparams_host", "iparams_host", "stop_ids_host", "bias_ids_host", "bias_values_host",
        "word_tokens_host", "word_lens_host")}
    tables["staged"] = {slot: (g.prompt.tolist(), g.output.tolist(),
                               None if g.allowed is None else g.allowed.tolist(), g.penalties,
                               g.specials.tolist()) for slot, g in st._staged.items()}
    return tables


def test_add_requests_writes_what_add_request_writes_row_by_row():
    """One write for many slots (widening the stop, bias and bad-word tables on the way)
    leaves every host table and staged write as the same requests added one at a time."""
    rng = random.Random(5)
    vocab, slots = 300, [3, 0, 7, 5, 1]
    reqs = [_random_request(rng, vocab, k) for k in range(len(slots))]
    reqs[2].params = reqs[2].params.replace(logit_bias={1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0},
                                            stop_token_ids=[5, 6, 9, 10])
    reqs[3].bad_words = [[4, 5, 6, 7], [8], [9, 10], [11, 12, 13]]
    outputs = [[], [4, -1], [], [2, 2, 2], []]
    one, many = (Sampler(8, vocab, device="cpu", eos_token_ids=EOS) for _ in range(2))
    for slot, r, out in zip(slots, reqs, outputs):
        one.add_request(slot, r.params, r.prompt, seed=r.params.seed + 1,
                        sample_index=r.sample_index, output_token_ids=out,
                        bad_words_token_ids=r.bad_words)
    many.add_requests(slots, [many.prepare(r.params, r.bad_words) for r in reqs],
                      [np.array(r.prompt) for r in reqs], seeds=[r.params.seed + 1 for r in reqs],
                      sample_indices=[r.sample_index for r in reqs], output_token_ids=outputs)
    want, got = _host_tables(one), _host_tables(many)
    assert want.keys() == got.keys()
    for name in want:
        if name == "staged":
            assert got[name] == want[name]
        else:
            assert np.array_equal(got[name], want[name]), name


def test_add_requests_checks_every_entry_before_writing_any():
    s = Sampler(4, 50, device="cpu", eos_token_ids=[0])
    rows = [s.prepare(SamplingParams(temperature=0.5)) for _ in range(3)]
    version = s.state.version
    cases = [
        (dict(prompt_token_ids=[np.array([1, 2]), np.array([3, 50]), np.array([4])]),
         "prompt_token_ids: token ids must be in \\[0, vocab_size\\) with vocab_size=50, got 50"),
        (dict(output_token_ids=[[], [], [-2]]), "output_token_ids: token ids must be in"),
        (dict(slots=[0, 2, 0]), "slot: each slot at most once"),
        (dict(slots=[0, 1, 4]), "slot: must be an int in \\[0, 4\\)"),
        (dict(seeds=[1, -1, 2]), "seed: must be an int in"),
        (dict(rows=[rows[0], SamplingParams(), rows[2]]), "rows: must come from Sampler.prepare"),
    ]
    for change, message in cases:
        args = dict(slots=[0, 1, 2], rows=rows,
                    prompt_token_ids=[np.array([1, 2]), [3], np.array([4], np.int32)],
                    seeds=[1, 2, 3], sample_indices=[0, 0, 1], output_token_ids=[[], [], []])
        args.update(change)
        with pytest.raises(ValueError, match=message):
            s.add_requests(args.pop("slots"), args.pop("rows"), args.pop("prompt_token_ids"),
                           **args)
        assert s.state.version == version and not s.state.active.any() and not s.state._staged
    prompt = np.array([1, 2, 3])
    s.add_requests([1], rows[:1], [prompt], seeds=[1], sample_indices=[0],
                   output_token_ids=[[]])
    prompt[0] = 40  # the sampler keeps its own copy
    assert s.state._staged[1].prompt.tolist() == [1, 2, 3]


def test_remove_then_add_before_a_step_uses_only_the_new_request():
    vocab = 50
    s = Sampler(2, vocab, device="cpu", eos_token_ids=[0])
    s.add_request(0, SamplingParams(temperature=0.0, repetition_penalty=3.0), list(range(1, 49)),
                  seed=0, output_token_ids=[9, 9, 9], bad_words_token_ids=[[49]])
    s.remove_request(0)
    s.add_request(0, SamplingParams(temperature=0.0, frequency_penalty=0.1), [2], seed=0)
    x = torch.arange(vocab, dtype=torch.float32)[None, :]
    out = s.sample(x.clone(), [0])
    assert out.token_ids.item() == 49  # no bad word, no repetition penalty from the old request
    assert s.state.output_counts[0].sum().item() == 1 and s.state.positions[0].item() == 1


def test_a_reused_slot_holds_the_rows_of_a_fresh_one():
    """Every host row of a slot is written whole: what an earlier request left there (bias,
    stop ids, bad words, parameters) is gone, as in a slot never used."""
    vocab = 50
    s = Sampler(3, vocab, device="cpu", eos_token_ids=[0])
    busy = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, min_tokens=2,
                          repetition_penalty=1.3, logprobs=3, stop_token_ids=[4, 5, 6],
                          logit_bias={7: 2.0, 8: 1.5, 3: -1.0}, seed=5)
    s.add_request(0, busy, [1, 2], seed=5, bad_words_token_ids=[[9, 10], [11]])
    s.add_request(2, busy, [1, 2], seed=5, bad_words_token_ids=[[9, 10], [11]])  # widths grown
    s.remove_request(0)
    plain = SamplingParams(temperature=0.0)
    s.add_request(0, plain, np.array([3, 4], dtype=np.int64), seed=1)
    s.add_request(1, plain, [3, 4], seed=1)
    st = s.state
    for rows in (st.fparams_host, st.iparams_host, st.stop_ids_host, st.bias_ids_host,
                 st.bias_values_host, st.word_tokens_host, st.word_lens_host):
        assert np.array_equal(rows[0], rows[1])
    assert np.array_equal(st.bias_ids_host[2], [7, 8, 3])
    assert np.array_equal(st.stop_ids_host[0], [0, -1, -1, -1])
    assert st.iparams_host[2].tolist() != st.iparams_host[0].tolist()


def test_invalid_calls_name_the_argument():
    s = Sampler(2, 10, device="cpu", eos_token_ids=[0])
    p = SamplingParams()
    with pytest.raises(ValueError, match="slot"):
        s.add_request(2, p, [1], seed=0)
    with pytest.raises(ValueError, match="seed"):
        s.add_request(0, p, [1], seed=-5)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_request(0, p, [10], seed=0)
    with pytest.raises(ValueError, match="output_token_ids"):
        s.add_request(0, p, [1], seed=0, output_token_ids=[-2])
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        s.add_request(0, p, [1], seed=0, bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="logprobs"):
        s.add_request(0, SamplingParams(logprobs=21), [1], seed=0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        s.add_request(0, SamplingParams(stop_token_ids=[10]), [1], seed=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        Sampler(2, 10, device="cpu", eos_token_ids=[10])
    with pytest.raises(ValueError, match="backend"):
        Sampler(2, 10, device="cpu", eos_token_ids=[0], backend="cuda-magic")
    s.add_request(0, p, [1], seed=0)
    with pytest.raises(ValueError, match="slots"):
        s.sample(torch.zeros(1, 10), [1])  # slot 1 has no request
    with pytest.raises(ValueError, match="slot appears twice"):
        s.sample(torch.zeros(2, 10), [0, 0])
    with pytest.raises(ValueError, match="logits"):
        s.sample(torch.zeros(1, 11), [0])
    with pytest.raises(ValueError, match="logits"):
        s.sample(torch.zeros(1, 10, dtype=torch.int64), [0])


def test_device_slots_replace_the_upload():
    """``device_slots`` (the engine's copy of the slots, uploaded with its step inputs) gives
    the same steps as host slots alone; a copy of the wrong shape or dtype is refused naming
    the argument."""
    vocab = 50
    runs = []
    for with_device in (False, True):
        s = Sampler(4, vocab, device="cpu", eos_token_ids=[0])
        for slot in range(4):
            s.add_request(slot, SamplingParams(temperature=0.7, seed=slot, logprobs=2,
                                               frequency_penalty=0.5), [1, 2], seed=slot)
        outs = []
        for step in range(4):
            slots = [3, 1, 0] if step % 2 else [2, 0]
            logits = torch.randn(len(slots), vocab, generator=torch.Generator().manual_seed(step))
            extra = {"device_slots": torch.tensor(slots)} if with_device else {}
            outs.append(s.sample(logits, slots, **extra))
        runs.append(outs)
    for a, b in zip(*runs):
        assert_same_output(a, b)
    s = Sampler(4, vocab, device="cpu", eos_token_ids=[0])
    s.add_request(0, SamplingParams(), [1], seed=0)
    s.add_request(1, SamplingParams(), [1], seed=0)
    with pytest.raises(ValueError, match="device_slots"):
        s.sample(torch.zeros(2, vocab), [0, 1], device_slots=torch.tensor([0]))
    with pytest.raises(ValueError, match="device_slots"):
        s.sample(torch.zeros(2, vocab), [0, 1], device_slots=torch.tensor([0, 1], dtype=torch.int32))
