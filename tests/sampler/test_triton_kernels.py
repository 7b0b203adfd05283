"""The Triton backend against the torch oracle (TRITON_INTERPRET=1 on CPU, the GPU otherwise).

Small shapes: the interpreter runs each program in Python.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams
from sampler.backends import available_backends
from sampler.ops.gumbel import compute_gumbel_noise, compute_hash_bits, compute_row_keys
from sampler.pipeline import run_pipeline
from sampler.step_plan import make_plan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE),
                                reason="triton is not installed")
MODES = ["raw_logprobs", "raw_logits", "temperature_logprobs"]


def random_params(rng: np.random.Generator, vocab: int, *, greedy: float = 0.2,
                  top_k=None) -> SamplingParams:
    """Random params; ``greedy``: the share of greedy rows, ``top_k``: the top-k choices."""
    greedy = rng.random() < greedy
    return SamplingParams(
        temperature=0.0 if greedy else float(rng.uniform(0.3, 2.0)),
        top_k=int(rng.choice([0, 1, 5, 50, vocab - 1, 300] if top_k is None else list(top_k))),
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.01])),
        min_p=float(rng.choice([0.0, 0.05])),
        seed=int(rng.integers(0, 2**62)),
        logprobs=int(rng.choice([0, 3, 20])),
        logprobs_mode=str(rng.choice(MODES)),
        repetition_penalty=float(rng.choice([1.0, 1.3])),
        frequency_penalty=float(rng.choice([0.0, 0.5])),
        presence_penalty=float(rng.choice([0.0, -0.3])),
        min_tokens=int(rng.choice([0, 5])),
        max_tokens=50,
        logit_bias={int(rng.integers(vocab)): 3.0} if rng.random() < 0.3 else None,
        allowed_token_ids=rng.choice(vocab, 40, replace=False).tolist()
        if rng.random() < 0.1 else None,
    )


def make_batch(seed: int, rows: int, vocab: int, *, max_num_seqs: int = 16, backend="torch",
               **choices):
    """A sampler holding ``rows`` random requests in random slots, plus the batch's slots
    (``choices``: :func:`random_params`'s keywords)."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(max_num_seqs, vocab, device=DEVICE, eos_token_ids=[2], backend=backend)
    slots = rng.permutation(max_num_seqs)[:rows]
    for slot in slots:
        params = random_params(rng, vocab, **choices)
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 20))).tolist()
        output = rng.integers(0, vocab, size=int(rng.integers(0, 8))).tolist()
        words = [[output[-1] if output else 5, 7], [9]] if rng.random() < 0.3 else []
        sampler.add_request(int(slot), params, prompt, seed=params.seed,
                            output_token_ids=output, bad_words_token_ids=words)
    return sampler, slots


def step_inputs(sampler: Sampler, slots: np.ndarray):
    """(state, plan, device row->slot mapping) of a step over ``slots``, pending state
    flushed."""
    state = sampler.state
    state.flush()
    return state, make_plan(state, slots), torch.as_tensor(slots, dtype=torch.int64,
                                                           device=DEVICE)


def both_backends(sampler: Sampler, slots: np.ndarray, logits: torch.Tensor):
    from sampler.kernels.launcher import run_pipeline_triton

    state, plan, idx = step_inputs(sampler, slots)
    ref = run_pipeline(logits.clone(), idx, state, plan, inplace=True)
    thresholds = torch.empty(len(slots), dtype=torch.float32, device=DEVICE)
    out = run_pipeline_triton(logits, idx, state, plan, inplace=False, thresholds=thresholds)
    # without thresholds, top-k-alone and top-p-alone rows draw first and verify the draw
    fast = run_pipeline_triton(logits, idx, state, plan, inplace=False)
    assert_same(out, fast)
    return ref, out, thresholds, plan


def assert_same(ref, out) -> None:
    assert torch.equal(ref.token_ids, out.token_ids)
    if ref.logprobs is None:
        assert out.logprobs is None
        return
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(out.ranks, ref.ranks)
    if ref.topk_ids is not None:
        assert torch.equal(out.topk_ids, ref.topk_ids)
        torch.testing.assert_close(out.topk_values, ref.topk_values, rtol=1e-5, atol=1e-5)


def _without_candidates():
    """The default launch config with the candidate path off: every row in the fused kernel
    (the tests of the fused kernel's own paths)."""
    import dataclasses

    from sampler.kernels.kernel_config import launch_config

    return dataclasses.replace(launch_config(1000), cand=False)


@pytest.mark.parametrize("cand", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_fused_kernel_matches_torch_pipeline(seed, cand):
    """Random batches (every feature): the default path (the candidate path's rows beside
    the fused kernel's) and the fused kernel alone equal torch."""
    from sampler.kernels.kernel_config import set_launch_config

    rows, vocab = (7, 1000) if seed % 2 else (3, 111)
    sampler, slots = make_batch(seed, rows, vocab)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if seed % 3 == 1 else torch.float32
    logits = (torch.randn(rows, vocab, generator=g) * (1 + seed % 4)).to(dtype).to(DEVICE)
    set_launch_config(None if cand else _without_candidates())
    try:
        ref, out, thresholds, _ = both_backends(sampler, slots, logits)
    finally:
        set_launch_config(None)
    assert_same(ref, out)


@pytest.mark.parametrize("cand", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_kept_sets_equal_oracle(seed, cand):
    """The kernel's kept set {t : processed_t / T >= threshold} is the torch pipeline's
    (default path and fused kernel alone)."""
    from sampler.kernels.kernel_config import set_launch_config

    set_launch_config(None if cand else _without_candidates())
    try:
        _kept_sets_equal_oracle(seed)
    finally:
        set_launch_config(None)


def _kept_sets_equal_oracle(seed):
    rows, vocab = 6, 400
    sampler, slots = make_batch(100 + seed, rows, vocab)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).mul(2.0).to(DEVICE)
    if seed == 3:  # ties everywhere
        logits = torch.round(logits * 2) / 2
    from sampler.kernels.launcher import run_pipeline_triton

    state, plan, idx = step_inputs(sampler, slots)
    processed = logits.clone()
    run_pipeline(processed, idx, state, plan, inplace=True)  # -> processed logits / T, masked
    thresholds = torch.empty(rows, device=DEVICE)
    run_pipeline_triton(logits, idx, state, plan, inplace=False, thresholds=thresholds)
    greedy = state.is_greedy[idx]
    # the values before the masks of steps 9-11: redo steps 2-8 on the torch path
    stats = logits.clone()
    plan28 = plan.__class__(**{**{f: getattr(plan, f) for f in plan.__slots__},
                               "do_min_p": False, "do_top_k": False, "do_top_p": False,
                               "modes": frozenset(), "max_num_logprobs": 0})
    run_pipeline(stats, idx, state, plan28, inplace=True)
    for r in range(rows):
        if greedy[r]:
            continue
        kept_ref = torch.isfinite(processed[r])
        kept_triton = torch.isfinite(stats[r]) & (stats[r] >= thresholds[r])
        assert torch.equal(kept_ref, kept_triton), f"row {r}"



def test_tie_group_larger_than_the_candidate_list_at_the_boundary():
    """A run of equal values longer than the candidate list straddles the top-k / top-p
    boundary (bf16 logits make such runs): refinement cannot split it and must keep it whole
    (tie-extended), never collapse the boundary bin."""
    from sampler.kernels.launcher import run_pipeline_triton

    vocab = 600
    specs = [SamplingParams(top_p=0.5, seed=1), SamplingParams(top_k=100, seed=2),
             SamplingParams(top_k=100, top_p=0.9, seed=3), SamplingParams(top_p=0.95, seed=4)]
    sampler = Sampler(4, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot, params in enumerate(specs):
        sampler.add_request(slot, params, [1], seed=params.seed)
    row = torch.full((vocab,), -2.0)
    row[10:15] = 2.0
    row[100:300] = -0.5  # 200 equal values: more than any candidate list of these tests
    logits = row.expand(len(specs), vocab).contiguous().to(DEVICE)
    slots = np.arange(len(specs))
    state, plan, idx = step_inputs(sampler, slots)
    processed = logits.clone()
    ref = run_pipeline(processed, idx, state, plan, inplace=True)
    thresholds = torch.empty(len(specs), device=DEVICE)
    out = run_pipeline_triton(logits, idx, state, plan, inplace=False, thresholds=thresholds)
    for r in range(len(specs)):
        kept_ref = torch.isfinite(processed[r])
        kept_triton = logits[r] >= thresholds[r]
        assert torch.equal(kept_ref, kept_triton), (r, int(kept_ref.sum()), int(kept_triton.sum()))
    assert torch.equal(out.token_ids, ref.token_ids)
    fast = run_pipeline_triton(logits, idx, state, plan, inplace=False)
    assert torch.equal(fast.token_ids, ref.token_ids)

def test_edge_rows():
    """All -inf, 99% -inf, k = 1 / V-1 / V with ties, p = 0.01: same as torch."""
    vocab = 200
    specs = [
        SamplingParams(top_k=1, seed=1), SamplingParams(top_k=vocab - 1, seed=2),
        SamplingParams(top_k=vocab, top_p=0.01, seed=3), SamplingParams(top_p=0.01, seed=4),
        SamplingParams(temperature=0.0, logprobs=5), SamplingParams(top_k=3, seed=5, logprobs=4),
    ]
    sampler = Sampler(8, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot, params in enumerate(specs):
        sampler.add_request(slot, params, [1], seed=params.seed or 0)
    logits = torch.round(torch.randn(len(specs), vocab, generator=torch.Generator().manual_seed(0)))
    logits[0] = float("-inf")
    logits[1, 2:] = float("-inf")
    logits[5, 10:] = float("-inf")
    logits = logits.to(DEVICE)
    ref, out, _, _ = both_backends(sampler, np.arange(len(specs)), logits)
    assert_same(ref, out)



@pytest.mark.parametrize("ties", [False, True])
def test_draw_then_verify_takes_both_branches(ties):
    """Top-k / top-p rows: the unrestricted draw is kept for some rows and rejected for others
    (the exact selection path then runs); tokens equal torch's."""
    vocab, rows = 200, 12
    sampler = Sampler(rows, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
    for slot in range(rows):
        # odd slots: top-p, with top-k too where min-p leaves at most k survivors
        params = (SamplingParams(temperature=1.0, top_p=(0.3, 0.7, 0.95)[slot % 3],
                                 top_k=150 if slot % 4 == 1 else 0,
                                 min_p=0.3 if slot % 4 == 1 else 0.0, seed=slot)
                  if slot % 2 else SamplingParams(temperature=1.0, top_k=(2, 10, 40)[slot % 3],
                                                  seed=slot, logprobs=3))
        sampler.add_request(slot, params, [1], seed=slot)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 0.5
    if ties:
        logits = torch.round(logits * 4) / 4
    logits = logits.to(DEVICE)
    slots = np.arange(rows)
    ref, out, _, plan = both_backends(sampler, slots, logits)
    assert_same(ref, out)
    # the draw without top-k / top-p: where it equals the sampled token the draw was kept
    state = sampler.state
    unrestricted = run_pipeline(logits.clone(), torch.as_tensor(slots, device=DEVICE), state,
                                plan.__class__(**{**{f: getattr(plan, f) for f in plan.__slots__},
                                                  "do_top_k": False, "do_top_p": False}),
                                inplace=True)
    kept = (unrestricted.token_ids == ref.token_ids).cpu()
    for parity in (0, 1):
        assert 0 < int(kept[parity::2].sum()) < rows // 2, (parity, kept)

def test_seeded_draw_independent_of_batch():
    """The same seeded row gives the same token alone and in a batch, in another slot."""
    from sampler.kernels.launcher import run_pipeline_triton

    vocab = 500
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    target = torch.randn(vocab, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    tokens = []
    for slot, rows in ((0, 1), (9, 12)):
        sampler = Sampler(16, vocab, device=DEVICE, eos_token_ids=[0], backend="torch")
        rng = np.random.default_rng(rows)
        slots = [s for s in range(16) if s != slot][: rows - 1] + [slot]
        for s in slots[:-1]:
            sampler.add_request(s, random_params(rng, vocab), [1, 2], seed=int(rng.integers(99)))
        sampler.add_request(slot, params, [1, 2], seed=1234)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        logits[-1] = target
        sampler.state.flush()
        plan = make_plan(sampler.state, np.array(slots))
        out = run_pipeline_triton(logits, torch.tensor(slots, device=DEVICE), sampler.state,
                                  plan, inplace=False)
        tokens.append(int(out.token_ids[-1]))
    assert tokens[0] == tokens[1]


def test_noise_bits_and_values_match_torch():
    from sampler.kernels.noise import compute_gumbel_noise as triton_noise

    seeds = torch.tensor([0, 1, 2**62 + 12345, 987654321], dtype=torch.int64)
    positions = torch.tensor([0, 5, 77, 2**33 + 1], dtype=torch.int64)
    sidx = torch.tensor([0, 3, 1, 7], dtype=torch.int64)
    ref = compute_gumbel_noise(seeds, positions, sidx, 777)
    out = triton_noise(seeds.to(DEVICE), positions.to(DEVICE), sidx.to(DEVICE), 777).cpu()
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    # the argmax over noise (the draw of a flat row) is the same token
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    bits = compute_hash_bits(compute_row_keys(seeds, positions, sidx), 777)
    assert bits.max() < 2**32 and bits.min() >= 0  # the oracle the kernel's bits follow


def test_noise_is_non_decreasing_in_the_bits():
    """The draw leaves out the noise of a tile whose lanes' bounds (largest value + the noise
    of the largest hash bits, plus 1e-3 of slack) are below the best score so far: sound only
    if the noise never falls as the bits grow, beyond rounding well inside that slack."""
    from sampler.kernels.noise import noise_of_bits
    from sampler.ops.gumbel import gumbel_from_bits

    g = torch.Generator().manual_seed(3)
    edges = torch.tensor([0, 1, 2, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 3, 2**32 - 2,
                          2**32 - 1], dtype=torch.int64)
    bits = torch.cat([torch.randint(0, 2**32, (1 << 15,), generator=g), edges]).sort().values
    noise = noise_of_bits(bits.to(DEVICE)).cpu()
    torch.testing.assert_close(noise, gumbel_from_bits(bits), rtol=2e-6, atol=2e-6)
    assert (noise[:-1] - noise[1:]).max().item() < 1e-5
    assert noise[0] < -3 and noise[-1] > 22  # both tails reached


def test_noise_upper_bound_holds():
    """The tile skip's per-token bound (``_gumbel_upper``) is above the noise of every hash
    value, by less than 0.09 where the noise is large (the tokens that can win a draw), so the
    1e-3 slack the passes add is for rounding only."""
    from sampler.kernels.noise import noise_of_bits

    g = torch.Generator().manual_seed(4)
    edges = torch.tensor([0, 1, 2, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 3, 2**32 - 2,
                          2**32 - 1], dtype=torch.int64)
    bits = torch.cat([torch.randint(0, 2**32, (1 << 15,), generator=g), edges,
                      2**32 - 1 - torch.randint(0, 2**20, (1 << 12,), generator=g)])
    noise = noise_of_bits(bits.to(DEVICE)).cpu()
    upper = noise_of_bits(bits.to(DEVICE), upper=True).cpu()
    assert (upper - noise).min().item() >= -1e-6 * noise.abs().max().item()
    large = noise > 3.0
    assert large.sum() > 1000
    assert (upper - noise)[large].max().item() < 0.09


@pytest.mark.parametrize("greedy_split,cand", [(True, True), (False, False), (False, True)])
def test_all_greedy_steps_with_sampled_logprobs(greedy_split, cand):
    """An all-greedy step without top-k logprobs runs pass 1 over vocab chunks and the fused
    kernel only combines them (the greedy split); that, the fused kernel alone and the
    candidate path equal torch, penalties and bias that move the argmax away from the raw one
    (rank counted over the row) included."""
    from sampler.kernels.kernel_config import LaunchConfig, launch_config, set_launch_config

    base = launch_config(1000)
    set_launch_config(LaunchConfig(**{**{f: getattr(base, f) for f in LaunchConfig.__slots__},
                                      "chunk": 256, "chunk_block": 64, "chunk_warps": 4,
                                      "greedy_split": greedy_split, "cand": cand}))
    try:
        rows, vocab = 6, 1000
        rng = np.random.default_rng(11)
        sampler = Sampler(8, vocab, device=DEVICE, eos_token_ids=[2])
        slots = rng.permutation(8)[:rows]
        for i, slot in enumerate(slots):
            params = SamplingParams(
                temperature=0.0, logprobs=0, seed=i, logprobs_mode=MODES[i % 3],
                repetition_penalty=1.5 if i % 2 else 1.0,
                logit_bias={int(rng.integers(vocab)): 30.0} if i == 4 else None)
            prompt = rng.integers(0, vocab, size=5).tolist()
            sampler.add_request(int(slot), params, prompt, seed=i, output_token_ids=[])
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)) * 2
        logits[1, 1:] -= 50.0  # row 1: the argmax is token 0 whatever the penalty
        logits = logits.to(DEVICE)
        ref, out, _, plan = both_backends(sampler, slots, logits)
        assert not plan.any_random and plan.max_num_logprobs == 0
        assert_same(ref, out)
        assert (out.ranks > 1).any()  # the bias moved row 4's token off the raw argmax
    finally:
        set_launch_config(None)


@pytest.mark.parametrize("cand", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_random_row,logprobs", [(False, False), (False, True),
                                                      (True, True)])
def test_greedy_ties_go_to_the_lowest_id(dtype, with_random_row, logprobs, cand):
    """Greedy rows whose maximum repeats within a lane, across tiles, across vocab chunks,
    or everywhere take the lowest id, as torch: all-greedy steps (one launch of the candidate
    statistics kernel, or with the path off the greedy split: without logprobs the best tile
    is kept in registers, with them it is read again) and greedy rows beside a random one
    (the candidate path, or with it off the fused kernel's pass 1, the best tile read
    again)."""
    from sampler.kernels.kernel_config import LaunchConfig, launch_config, set_launch_config
    from sampler.kernels.launcher import run_pipeline_triton

    rows, vocab = 5, 1000
    sampler = Sampler(8, vocab, device=DEVICE, eos_token_ids=[2])
    for i in range(rows):
        greedy = not (with_random_row and i == rows - 1)
        sampler.add_request(i, SamplingParams(temperature=0.0 if greedy else 0.8,
                                              logprobs=0 if logprobs and i != 3 else None,
                                              logprobs_mode=MODES[i % 3]), [1, 2, 3], seed=i)
    slots = np.arange(rows)
    base = launch_config(vocab)
    set_launch_config(LaunchConfig(**{**{f: getattr(base, f) for f in LaunchConfig.__slots__},
                                      "chunk": 256, "chunk_block": 64, "chunk_warps": 4,
                                      "cand": cand}))
    try:
        for step in range(2):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(step)) * 2
            logits[0, [3, 5, 700]] = 9.0  # one lane (3, 5), another chunk (700)
            logits[1, [130, 900]] = 9.0  # two tiles of one chunk, a later chunk
            logits[2, :] = -4.0  # every token ties
            logits[3, [999, 998]] = 9.0  # the last lane of the row
            logits = logits.to(device=DEVICE, dtype=dtype)
            state, plan, idx = step_inputs(sampler, slots)
            assert plan.any_random == with_random_row and plan.any_logprobs == logprobs
            ref = run_pipeline(logits.float().clone(), idx, state, plan, inplace=True)
            out = run_pipeline_triton(logits, idx, state, plan, inplace=False)
            assert out.token_ids[:4].tolist() == [3, 130, 0, 998]
            assert_same(ref, out)
            state.record_sampled(idx, out.token_ids, slots)
    finally:
        set_launch_config(None)


def test_processing_kernel_matches_torch_ops():
    """Steps 2-6 alone: penalties, bias, bans, min_tokens, allowed (bit for bit in fp32)."""
    from sampler.kernels.tables import compute_bad_word_bans
    from sampler.kernels.process import apply_processing

    rows, vocab = 7, 300
    sampler, slots = make_batch(42, rows, vocab)
    state = sampler.state
    state.flush()
    plan = make_plan(state, slots)
    only = plan.__class__(**{**{f: getattr(plan, f) for f in plan.__slots__},
                             "any_greedy": True, "any_random": False, "do_temperature": False,
                             "do_min_p": False, "do_top_k": False, "do_top_p": False,
                             "modes": frozenset(), "max_num_logprobs": 0})
    idx = torch.as_tensor(slots, dtype=torch.int64, device=DEVICE)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = logits.clone()
    from sampler.ops import (apply_allowed_token_ids, apply_bad_words, apply_logit_bias,
                             apply_min_tokens, apply_penalties)
    from sampler.slot_params import FREQUENCY, MIN_TOKENS, PRESENCE, REPETITION

    if only.do_allowed:
        apply_allowed_token_ids(ref, idx, state.has_allowed, state.allowed_mask)
    if only.do_bad_words:
        apply_bad_words(ref, idx, state.word_tokens, state.word_lens, state.recent_tokens)
    if only.do_min_tokens:
        apply_min_tokens(ref, idx, state.positions, state.iparams[:, MIN_TOKENS], state.stop_ids)
    if only.do_logit_bias:
        apply_logit_bias(ref, idx, state.bias_ids, state.bias_values)
    if only.do_penalties:
        f = state.fparams
        apply_penalties(ref, idx, state.prompt_mask, state.output_counts, f[:, REPETITION],
                        f[:, FREQUENCY], f[:, PRESENCE])
    assert only.do_penalties and only.do_bad_words and only.do_logit_bias
    out = logits.clone()
    apply_processing(out, idx, state, only, compute_bad_word_bans(idx, state))
    assert torch.equal(out, ref)


def test_stateful_sampler_triton_equals_torch_over_steps():
    """20 steps of a persistent batch (add/remove, penalties, bad words): same tokens, and the
    penalty bits follow the sampled ids."""
    vocab, steps = 300, 20
    a, slots = make_batch(5, 6, vocab, backend="torch")
    b, _ = make_batch(5, 6, vocab, backend="triton")
    rng = np.random.default_rng(0)
    active = list(slots)
    for step in range(steps):
        logits = torch.randn(len(active), vocab, generator=torch.Generator().manual_seed(step))
        logits = logits.to(DEVICE)
        out_a = a.sample(logits.clone(), active)
        out_b = b.sample(logits.clone(), active)
        assert torch.equal(out_a.token_ids, out_b.token_ids), f"step {step}"
        if step % 5 == 4:  # recycle a slot
            slot = active.pop(int(rng.integers(len(active))))
            for s in (a, b):
                s.remove_request(int(slot))
                s.add_request(int(slot), SamplingParams(repetition_penalty=1.5, top_k=7, seed=3),
                              [1, 2, 3], seed=3)
            active.append(slot)
    bits = b.state.penalty_bits
    counts = b.state.output_counts
    for slot in active:
        seen = b.state.prompt_mask[slot] | (counts[slot] > 0)
        expect = torch.zeros(bits.shape[1] * 32, dtype=torch.bool, device=DEVICE)
        expect[:vocab] = seen
        got = ((bits[slot].to(torch.int64)[:, None] >> torch.arange(32, device=DEVICE)) & 1)
        assert torch.equal(got.reshape(-1).bool(), expect)


def test_sliced_vocab_and_bf16():
    """A vocab slice of a padded bf16 tensor (non-contiguous rows) works."""
    from sampler.kernels.launcher import run_pipeline_triton

    vocab = 250
    sampler, slots = make_batch(11, 5, vocab)
    padded = torch.randn(5, 320, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits = padded.to(DEVICE)[:, :vocab]
    state, plan, idx = step_inputs(sampler, slots)
    ref = run_pipeline(logits.contiguous(), idx, state, plan, inplace=False)
    before = logits.clone()
    out = run_pipeline_triton(logits, idx, state, plan, inplace=False)
    assert_same(ref, out)
    assert torch.equal(logits, before)  # the raw snapshot stays pristine


@pytest.mark.parametrize("hist,skip", [(False, False), (True, True)])
def test_kernel_variants_agree(hist, skip):
    """Per-lane bin counts and the no-skip sampling pass give the torch pipeline's results
    too (as do the defaults, histograms and skipped tiles)."""
    from sampler.kernels.kernel_config import LaunchConfig, launch_config, set_launch_config

    base = launch_config(1000)
    set_launch_config(LaunchConfig(block=base.block, num_warps=base.num_warps, cap=base.cap,
                                   hist=hist, skip=skip, cand=False))
    try:
        rows, vocab = 7, 1000
        sampler, slots = make_batch(77, rows, vocab)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        ref, out, _, _ = both_backends(sampler, slots, logits * 2)
        assert_same(ref, out)
    finally:
        set_launch_config(None)


def test_prefetch_depths_give_identical_outputs():
    """The row-pass loops requesting tiles 0, 1 or 2 iterations ahead (``LaunchConfig.prefetch``;
    several tiles per row, the last one partial): every output bit the same, and the torch
    pipeline's results; with and without the draw-first paths."""
    import dataclasses

    from sampler.kernels.kernel_config import launch_config, set_launch_config
    from sampler.kernels.launcher import run_pipeline_triton

    base = dataclasses.replace(launch_config(1000), block=128, cand=False)
    rows, vocab = 9, 1000
    sampler, slots = make_batch(91, rows, vocab)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9)).to(DEVICE) * 2
    state, plan, idx = step_inputs(sampler, slots)
    ref = run_pipeline(logits.clone(), idx, state, plan, inplace=True)
    outs = []
    try:
        for depth in (0, 1, 2):
            set_launch_config(dataclasses.replace(base, prefetch=depth))
            thr = torch.empty(rows, dtype=torch.float32, device=DEVICE)
            outs.append((run_pipeline_triton(logits, idx, state, plan, inplace=False,
                                             thresholds=thr), thr,
                         run_pipeline_triton(logits, idx, state, plan, inplace=False)))
    finally:
        set_launch_config(None)
    for out, thr, fast in outs:
        assert_same(ref, out)
        assert_same(out, fast)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    for out, thr, fast in outs[1:]:
        for a, b in ((out, outs[0][0]), (fast, outs[0][2])):
            assert torch.equal(a.token_ids, b.token_ids)
            torch.testing.assert_close(a.logprobs, b.logprobs, **exact)
            assert torch.equal(a.ranks, b.ranks)
            assert torch.equal(a.topk_ids, b.topk_ids)
            torch.testing.assert_close(a.topk_values, b.topk_values, **exact)
        torch.testing.assert_close(thr, outs[0][1], **exact)


def _top_k_batch(seed: int, rows: int, vocab: int, *, greedy_only: bool = False,
                 top_k=(1, 5, 20, 50, 300)):
    """:func:`make_batch` with 30% greedy rows (or only greedy ones) and the random rows'
    top-k drawn from ``top_k`` (0: none)."""
    return make_batch(seed, rows, vocab, greedy=1.0 if greedy_only else 0.3, top_k=top_k)


def test_rows_do_not_depend_on_batch_mates():
    """A row's path (candidate path or fused kernel) and results are its own: each row of a
    mixed batch (top-k rows, greedy rows, a random row without top-k) run alone gives the
    same token, logprob, rank and top-k as in the batch."""
    from sampler.kernels.launcher import run_pipeline_triton

    rows, vocab = 5, 600
    sampler, slots = _top_k_batch(21, rows, vocab)
    free = int(np.setdiff1d(np.arange(16), slots)[0])
    sampler.add_request(free, SamplingParams(temperature=0.9, top_p=0.8, logprobs=3, seed=9),
                        [1, 2], seed=9)
    slots = np.append(slots, free)
    logits = torch.randn(rows + 1, vocab, generator=torch.Generator().manual_seed(4)) * 2
    state = sampler.state
    state.flush()

    def run(sel):
        idx = torch.as_tensor(slots[sel], dtype=torch.int64, device=DEVICE)
        return run_pipeline_triton(logits[sel].to(DEVICE), idx, state,
                                   make_plan(state, slots[sel]), inplace=False)
    together = run(np.arange(rows + 1))
    for r in range(rows + 1):
        alone = run(np.array([r]))
        assert together.token_ids[r] == alone.token_ids[0], f"row {r}"
        assert torch.equal(together.logprobs[r:r + 1], alone.logprobs)
        assert together.ranks[r] == alone.ranks[0]
        if alone.topk_ids is None:  # logprobs=0: padding in the batch
            assert (together.topk_ids[r] == -1).all()
        else:
            k = alone.topk_ids.shape[1]
            assert torch.equal(together.topk_ids[r, :k], alone.topk_ids[0])
            assert torch.equal(together.topk_values[r, :k], alone.topk_values[0])
