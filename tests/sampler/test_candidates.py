"""The Triton candidate path (``sampler.kernels.candidate_stats`` and ``candidate_finish``) against the torch oracle, and the
one-launch record of a step (``sampler.kernels.record``): TRITON_INTERPRET=1 on the CPU, the
GPU otherwise. Small shapes: the interpreter runs each program in Python."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams
from sampler.backends import available_backends
from sampler.pipeline import run_pipeline
from sampler.slot_params import HAS_ALLOWED, IS_GREEDY, MODE, NUM_LOGPROBS, TOP_K

from tests.sampler.test_triton_kernels import DEVICE, assert_same, make_batch, step_inputs

pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE),
                                reason="triton is not installed")


def _config(**changes):
    from sampler.kernels.kernel_config import launch_config

    return dataclasses.replace(launch_config(1000), **changes)


def _run(sampler, slots, logits, config=None):
    """(torch output, Triton output, per-row candidate flags, thresholds, plan)."""
    from sampler.kernels.kernel_config import set_launch_config
    from sampler.kernels.launcher import run_pipeline_triton

    state, plan, idx = step_inputs(sampler, slots)
    ref = run_pipeline(logits.clone(), idx, state, plan, inplace=True)
    scratch: dict = {}
    thresholds = torch.empty(len(slots), dtype=torch.float32, device=DEVICE)
    set_launch_config(config)
    try:
        out = run_pipeline_triton(logits, idx, state, plan, inplace=False, scratch=scratch,
                                  thresholds=thresholds)
    finally:
        set_launch_config(None)
    done = scratch.get("cand_done")
    return ref, out, None if done is None else done.cpu(), thresholds, plan


def _eligible(sampler, slots, kmax: int) -> np.ndarray:
    """Rows the candidate path takes by their params (greedy, or top-k <= kmax; top raw-family
    logprobs <= kmax; no allowed ids)."""
    i = sampler.state.iparams_host[slots]
    greedy = i[:, IS_GREEDY] != 0
    k = np.where(greedy, 0, i[:, TOP_K])
    raw = np.isin(i[:, MODE], (0, 1, 4))
    nlp = np.where(raw & (i[:, NUM_LOGPROBS] > 0), i[:, NUM_LOGPROBS], 0)
    return (greedy | (k > 0)) & (np.maximum(k, nlp) <= kmax) & (i[:, HAS_ALLOWED] == 0)


@pytest.mark.parametrize("seed", range(8))
def test_candidate_path_matches_torch(seed):
    """Random batches of greedy and top-k rows (penalties, bias, bad words, min_tokens, every
    raw logprobs mode, fp32 / bf16, ties) with batch-mates the path does not take: tokens,
    logprobs, ranks, top logprobs and kept sets equal torch's, and the eligible rows settle on
    the candidate path."""
    rows, vocab = [(7, 1000), (3, 111), (5, 3000), (6, 700)][seed % 4]
    sampler, slots = make_batch(200 + seed, rows, vocab, top_k=[1, 5, 50, 0])
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * (1 + seed % 4)
    if seed % 4 == 3:  # runs of ties everywhere
        logits = torch.round(logits * 2) / 2
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    logits = logits.to(dtype).to(DEVICE)
    ref, out, done, thresholds, _ = _run(sampler, slots, logits)
    assert_same(ref, out)
    eligible = _eligible(sampler, slots, _config().cand_kmax)
    assert done is not None
    assert (done.numpy()[~eligible] == 0).all()
    assert (done.numpy()[eligible] > 0).all(), (done, eligible)
    # kept sets: {t : processed_t / T >= threshold} is the torch pipeline's
    state, plan, idx = step_inputs(sampler, slots)
    processed = logits.float().clone()
    run_pipeline(processed, idx, state, plan, inplace=True)
    stats = logits.float().clone()
    plan28 = dataclasses.replace(plan, do_min_p=False, do_top_k=False, do_top_p=False,
                                 modes=frozenset(), max_num_logprobs=0)
    run_pipeline(stats, idx, state, plan28, inplace=True)
    for r in np.flatnonzero(eligible & (sampler.state.iparams_host[slots, IS_GREEDY] == 0)):
        kept_ref = torch.isfinite(processed[r])
        kept = torch.isfinite(stats[r]) & (stats[r] >= thresholds[r])
        assert torch.equal(kept_ref, kept), f"row {r}"


def test_every_row_on_the_path():
    """A batch the path takes whole (greedy + top-k rows, no allowed ids): no fused launch is
    needed for the ineligible, and every row settles; top-k from 1 to 40."""
    vocab = 2000
    kmax = _config().cand_kmax
    specs = [SamplingParams(temperature=0.0, logprobs=5),
             SamplingParams(top_k=1, seed=1, logprobs=0),
             SamplingParams(top_k=40, top_p=0.8, seed=2, logprobs=3),
             SamplingParams(top_k=7, min_p=0.1, temperature=1.7, seed=3),
             SamplingParams(top_k=20, temperature=0.6, seed=4, logprobs=20,
                            logprobs_mode="temperature_logprobs"),
             SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="raw_logits")]
    sampler = Sampler(8, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot, params in enumerate(specs):
        sampler.add_request(slot, params, [1, 2], seed=slot)
    slots = np.arange(len(specs))
    for step in range(2):
        logits = (torch.randn(len(specs), vocab, generator=torch.Generator().manual_seed(step))
                  * 2.5).to(DEVICE)
        ref, out, done, _, plan = _run(sampler, slots, logits)
        assert plan.max_select_k <= kmax and not plan.do_allowed
        assert_same(ref, out)
        assert (done > 0).all()
        sampler.state.record_sampled(torch.as_tensor(slots, device=DEVICE), ref.token_ids,
                                     slots)


def test_touched_tokens_move_across_the_top_k():
    """Penalties, bias, bans and min_tokens move tokens into and out of the top-k: a prompt
    token with the largest raw value falls below others, a low token biased to the top wins
    greedy rows, a banned raw argmax is never sampled, stop ids stay masked until min_tokens."""
    vocab, rows = 1500, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9))
    logits[:, 100] = 8.0  # the raw argmax: a prompt token (repetition) or banned
    logits[:, 7] = 7.5  # a stop id (masked while min_tokens holds)
    logits[:, 1300] = -3.0  # biased up to the top
    specs = [
        SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias={1300: 12.0}, logprobs=0),
        SamplingParams(top_k=3, seed=5, repetition_penalty=4.0, frequency_penalty=1.0,
                       logprobs=5),
        SamplingParams(top_k=2, seed=6, min_tokens=3, stop_token_ids=[7], logprobs=2),
        SamplingParams(top_k=4, seed=7, logit_bias={1300: 11.5, 100: -20.0}),
        SamplingParams(temperature=0.0, logprobs=4, presence_penalty=2.0),
    ]
    words = [[], [], [], [[100]], [[3, 100]], []]
    sampler = Sampler(8, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot, (params, w) in enumerate(zip(specs, words)):
        sampler.add_request(slot, params, [100, 50], seed=slot,
                            output_token_ids=[3, 100][:slot % 3], bad_words_token_ids=w)
    slots = np.arange(rows)
    for step in range(3):
        ref, out, done, _, _ = _run(sampler, slots, logits.to(DEVICE))
        assert_same(ref, out)
        assert (done > 0).all(), done
        toks = out.token_ids.tolist()
        assert toks[0] != 100 and toks[1] == 1300 and toks[3] not in (7, 100)
        sampler.state.record_sampled(torch.as_tensor(slots, device=DEVICE), ref.token_ids,
                                     slots)


def test_greedy_ties_and_ranks_counted_over_the_row():
    """Greedy ties across lanes, tiles and chunks go to the lowest id, also between a touched
    token and untouched ones; a greedy token moved off the raw argmax by a penalty gets its
    rank counted over the row (done = 2)."""
    vocab, rows = 2500, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    logits[0, [1800, 40, 41]] = 6.0  # two chunks, one lane
    logits[1, :] = -1.0  # every token ties
    logits[2, [900, 30]] = 6.0  # 30 is biased by 0: touched, tied with untouched 900
    logits[3, 5] = 9.0  # a prompt token: repetition moves the argmax off it
    specs = [SamplingParams(temperature=0.0, logprobs=0),
             SamplingParams(temperature=0.0, logprobs=0),
             SamplingParams(temperature=0.0, logprobs=0, logit_bias={30: 0.0}),
             SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=10.0)]
    sampler = Sampler(4, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot, params in enumerate(specs):
        sampler.add_request(slot, params, [5], seed=slot)
    # an all-greedy step without top logprobs runs the greedy split unless it is off
    ref, out, done, _, _ = _run(sampler, np.arange(rows), logits.to(DEVICE),
                                _config(greedy_split=False))
    assert_same(ref, out)
    assert out.token_ids[:3].tolist() == [40, 0, 30]
    assert done.tolist()[:3] == [1, 1, 1] and done.tolist()[3] == 2
    assert int(out.ranks[3]) == 2


@pytest.mark.parametrize("change", [dict(cand_cap=64), dict(cand_tcap=16), dict(cand_kmax=4),
                                    dict(cand_cellcap=8)])
def test_rows_the_path_cannot_settle_go_to_the_fused_kernel(change):
    """Candidate or touched lists that overflow, and rows beyond the path's top-k bound, are
    left to the fused kernel (done = 0): the step's outputs still equal torch's."""
    sampler, slots = make_batch(77, 6, 3000, top_k=[5, 50])
    for slot in slots[:3]:  # long prompts with penalties: many touched tokens
        p = SamplingParams(top_k=50, repetition_penalty=1.2, logprobs=5, seed=int(slot))
        sampler.add_request(int(slot), p, list(range(0, 3000, 90)), seed=int(slot))
    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE)
    ref, out, done, _, _ = _run(sampler, slots, logits, _config(**change))
    assert_same(ref, out)
    # the long-prompt top-k 50 rows: too many candidates for 64 entries, touched tokens for
    # 16, a top-k beyond 4, more than 8 cells of a chunk reaching its bound
    assert (done[:3] == 0).all(), done


@pytest.mark.parametrize("seed", range(2))
def test_cells_of_several_tiles(seed):
    """Chunks of 32 tiles, so a cell holds a lane's tokens of 8 consecutive tiles (the GPU
    shape; the interpreter's default chunks have one-tile cells), over three chunks, the last
    one partial, touch words expanded 8 at a time: the outputs equal torch's and the eligible
    rows settle on the path."""
    vocab = 20000
    sampler, slots = make_batch(300 + seed, 6, vocab, top_k=[1, 5, 50, 0])
    for slot in slots[:2]:  # touched tokens in every chunk
        p = SamplingParams(top_k=50, repetition_penalty=1.3, frequency_penalty=0.5,
                           logprobs=5, seed=int(slot))
        sampler.add_request(int(slot), p, list(range(7, vocab, 301)), seed=int(slot))
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits = logits.to(torch.bfloat16 if seed else torch.float32).to(DEVICE)
    ref, out, done, _, _ = _run(sampler, slots, logits,
                                _config(cand_chunk=8192, cand_block=256, cand_vec=4,
                                        cand_gw=8))
    assert_same(ref, out)
    eligible = _eligible(sampler, slots, _config().cand_kmax)
    assert (done.numpy()[eligible] > 0).all(), (done, eligible)


def test_all_greedy_steps_without_top_logprobs_take_the_greedy_split():
    """The path is skipped where the greedy split is faster (all-greedy, no top logprobs);
    a greedy row with top logprobs brings it back."""
    vocab = 900
    sampler = Sampler(3, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot in range(3):
        sampler.add_request(slot, SamplingParams(temperature=0.0, logprobs=0), [1], seed=slot)
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    ref, out, done, _, _ = _run(sampler, np.arange(3), logits)
    assert done is None
    assert_same(ref, out)
    sampler.add_request(2, SamplingParams(temperature=0.0, logprobs=2), [1], seed=2)
    ref, out, done, _, _ = _run(sampler, np.arange(3), logits)
    assert done is not None and (done > 0).all()
    assert_same(ref, out)


def test_path_off_gives_the_same_outputs():
    """With the candidate path off (the fused kernel alone) the outputs are the same."""
    sampler, slots = make_batch(5, 7, 1000, top_k=[1, 5, 50])
    logits = (torch.randn(7, 1000, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE)
    ref, on, done, _, _ = _run(sampler, slots, logits)
    _, off, none, _, _ = _run(sampler, slots, logits, _config(cand=False))
    assert none is None and (done > 0).any()
    assert_same(ref, on)
    assert_same(on, off)


def test_touch_bits_mark_what_steps_2_to_6_can_change():
    """A slot's touch bits: prompt and output tokens with penalties, bias ids, stop ids with
    min_tokens, bad words' last tokens; a sampled token is added for rows with penalties."""
    vocab = 200
    sampler = Sampler(4, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    sampler.add_request(0, SamplingParams(repetition_penalty=1.1, seed=1), [5, 6], seed=1,
                        output_token_ids=[7])
    sampler.add_request(1, SamplingParams(logit_bias={9: 1.0}, min_tokens=2,
                                          stop_token_ids=[11], seed=2), [5], seed=2,
                        bad_words_token_ids=[[12, 13], [14]])
    sampler.add_request(2, SamplingParams(seed=3), [5, 6], seed=3)
    sampler.state.flush()

    def marked(slot):
        bits = sampler.state.touch_bits[slot].cpu().numpy().view(np.uint32)
        return {int(t) for t in range(vocab) if (bits[t >> 5] >> (t & 31)) & 1}

    assert marked(0) == {5, 6, 7}
    assert marked(1) == {9, 11, 0, 13, 14}
    assert marked(2) == set()
    idx = torch.tensor([0, 1, 2], device=DEVICE)
    sampler.state.record_sampled(idx, torch.tensor([40, 41, 42], device=DEVICE), [0, 1, 2])
    assert marked(0) == {5, 6, 7, 40} and 41 not in marked(1) and marked(2) == set()


def test_triton_record_matches_the_torch_record():
    """The one-launch record leaves every device table as the state's torch ops do: output
    positions, counts, penalty and touch bits, recent tokens (bad words up to 3 tokens)."""
    from sampler.kernels.record import record_sampled_triton

    vocab = 400
    a, slots = make_batch(31, 6, vocab)
    b, _ = make_batch(31, 6, vocab)
    for s in (a, b):  # a bad word of three tokens: a recent-token window of two; a row
        # with touch bits (a bias) but no penalties: its sampled tokens are not marked
        s.add_request(int(slots[0]), SamplingParams(repetition_penalty=1.3, seed=1), [3, 4],
                      seed=1, output_token_ids=[8, 9], bad_words_token_ids=[[8, 9, 10]])
        s.add_request(int(slots[1]), SamplingParams(logit_bias={5: 1.0}, seed=2), [3],
                      seed=2)
    rng = np.random.default_rng(0)
    for _step in range(4):
        a.state.flush()
        b.state.flush()
        idx = torch.as_tensor(slots, dtype=torch.int64, device=DEVICE)
        toks = torch.as_tensor(rng.integers(0, vocab, len(slots)), dtype=torch.int64,
                               device=DEVICE)
        a.state.record_sampled(idx, toks, slots)
        record_sampled_triton(b.state, idx, toks, slots)
        for name in ("positions", "output_counts", "penalty_bits", "touch_bits",
                     "recent_tokens"):
            ta, tb = getattr(a.state, name), getattr(b.state, name)
            assert ta is not None and torch.equal(ta, tb), name
        assert (a.state.pos_host == b.state.pos_host).all()


def _collide(T: float) -> tuple[float, float]:
    """Two adjacent float32 values whose quotients by ``T`` round to the same float32."""
    for v in np.linspace(1.5, 2.5, 101, dtype=np.float32):
        u = np.nextafter(v, np.float32(0))
        if v / np.float32(T) == u / np.float32(T):
            return float(v), float(u)
    raise AssertionError("no colliding pair")


@pytest.mark.parametrize("unlisted", [(0, 4), (501, 505)])
def test_rounding_ties_with_unlisted_tokens_go_to_the_fused_kernel(unlisted):
    """A token below a chunk's bound is left out of the list, but its value / T can round to
    the kept set's threshold (a tie the spec keeps) or its temperature logprob to the n-th top
    one: such rows are left to the fused kernel (done = 0), whose kept sets, draws and top
    logprobs then equal torch's. Without the check the draws differ. The unlisted tokens sit
    in cells below the bound (0, 4) or in the cells of tokens at it (501, 505: read again,
    then left out)."""
    from sampler.kernels.kernel_config import launch_config

    T, vocab = 1.3, 1000
    v, u = _collide(T)
    assert launch_config(vocab).cand_chunk >= vocab  # one chunk: lanes of 4 tokens a tile
    logits = torch.full((9, vocab), -3.0) + torch.rand(9, vocab) * 0.1
    logits[:, [500, 504, 508]] = v  # three lanes at v: the chunk bound for K = 3
    logits[:, list(unlisted)] = u  # below the bound: unlisted, yet u / T == v / T
    logits[8, 496] = 3.0  # row 8: a top token; its n-th (3rd) top logprob ties with u's
    sampler = Sampler(9, vocab, device=DEVICE, eos_token_ids=[999], backend="torch")
    for slot in range(8):  # top-3: the tie at the threshold keeps all five tokens
        sampler.add_request(slot, SamplingParams(temperature=T, top_k=3, seed=slot), [1],
                            seed=slot)
    sampler.add_request(8, SamplingParams(temperature=T, top_k=1, logprobs=3, seed=8,
                                          logprobs_mode="temperature_logprobs"), [1], seed=8)
    ref, out, done, thresholds, _ = _run(sampler, np.arange(9), logits.to(DEVICE))
    assert (done == 0).all(), done
    assert_same(ref, out)
    assert {int(t) for t in ref.token_ids[:8]} & set(unlisted)  # some draws are the ties
    assert ref.topk_ids[8].tolist() == [496] + sorted([*unlisted, 500, 504, 508])[:2]


def test_touched_tokens_at_the_top_k_boundary():
    """A touched token (a zero logit bias: processed value = raw) just inside the top-k, and
    among the top raw logprobs, a little above the largest unlisted value: the finish kernel
    adds it to the candidates (same kept set, draws and top logprobs as torch)."""
    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)).clamp(-3, 3) - 5
    logits[:, [500, 504, 508]] = 1.5  # three lanes
    logits[:, 12] = 1.30  # touched: the 4th largest value and raw logit
    logits[:, 520] = 1.29  # rows 0-3 (K = 4): the chunk bound, so 540 is left out
    logits[:, 540] = 1.25  # rows 4-5 (K = 5): the bound, so 530 is left out
    logits[:, 530] = 1.0
    sampler = Sampler(6, vocab, device=DEVICE, eos_token_ids=[999], backend="torch")
    for slot in range(6):
        params = SamplingParams(top_k=4, seed=slot, logit_bias={12: 0.0},
                                logprobs=5 if slot >= 4 else None)
        sampler.add_request(slot, params, [1], seed=slot)
    ref, out, done, thresholds, _ = _run(sampler, np.arange(6), logits.to(DEVICE))
    assert (done > 0).all()
    assert_same(ref, out)
    assert torch.equal(thresholds.cpu(), torch.full((6,), 1.30, dtype=torch.float32))
    assert 12 in out.token_ids.tolist()
    assert out.topk_ids[4].tolist() == [500, 504, 508, 12, 520]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_steps_in_one_launch(dtype):
    """All-greedy steps of unprocessed logits without top logprobs run as the statistics
    kernel alone, each row finished by its last chunk program: over three chunks, with ties
    within a lane, across chunks and everywhere, every raw logprobs mode and rows without
    logprobs, tokens, logprobs, ranks and the recorded state equal the torch sampler's over
    steps, and the per-row arrival counts are back at 0 after each step."""
    from sampler.kernels import kernel_config, launcher
    from sampler.step_plan import make_plan

    vocab, rows = 3000, 5
    assert kernel_config.launch_config(vocab).cand_chunk < vocab / 2  # three chunks a row
    samplers = [Sampler(8, vocab, device=DEVICE, eos_token_ids=[2], backend=b)
                for b in ("torch", "triton")]
    modes = ["raw_logprobs", "raw_logits", "temperature_logprobs"]
    slots = [6, 1, 3, 0, 4]
    for i, slot in enumerate(slots):
        params = SamplingParams(temperature=0.0, logprobs=None if i == 3 else 0,
                                logprobs_mode=modes[i % 3])
        for s in samplers:
            s.add_request(slot, params, [1, 2, 3], seed=i, bad_words_token_ids=())
    launches = []
    real = launcher._run_greedy_one

    def spy(*args, **kwargs):
        launches.append(1)
        return real(*args, **kwargs)

    launcher._run_greedy_one = spy
    try:
        for step in range(3):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(step)) * 2
            logits[0, [3, 5, 2700]] = 9.0  # one lane (3, 5) and the last chunk
            logits[1, [1500, 2999]] = 9.0  # the middle chunk first
            logits[2, :] = -4.0  # every token ties
            logits = logits.to(device=DEVICE, dtype=dtype)
            plan = make_plan(samplers[1].state, np.asarray(slots))
            assert launcher.greedy_one(kernel_config.launch_config(vocab), plan)
            ref, out = (s.sample(logits.clone(), slots) for s in samplers)
            assert out.token_ids[:3].tolist() == [3, 1500, 0]
            assert_same(ref, out)
            assert len(launches) == step + 1
            assert int(samplers[1].state.arrivals.abs().sum()) == 0
            for name in ("positions", "recent_tokens"):
                ta, tb = (getattr(s.state, name) for s in samplers)
                assert (ta is None and tb is None) or torch.equal(ta, tb), name
    finally:
        launcher._run_greedy_one = real
    # a penalty (the logits change) or top logprobs: not this path
    for s in samplers:
        s.add_request(7, SamplingParams(temperature=0.0, repetition_penalty=1.2), [1], seed=7)
    plan = make_plan(samplers[1].state, np.asarray(slots + [7]))
    assert not launcher.greedy_one(kernel_config.launch_config(vocab), plan)
    for s in samplers:
        s.add_request(7, SamplingParams(temperature=0.0, logprobs=2), [1], seed=7)
    plan = make_plan(samplers[1].state, np.asarray(slots + [7]))
    assert not launcher.greedy_one(kernel_config.launch_config(vocab), plan)
