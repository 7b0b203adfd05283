"""GPU tests of the sampler backends (``pytest -m gpu`` on a CUDA machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import AsyncOutput, Sampler, SamplingParams, derive_seed
from sampler.pipeline import run_pipeline
from sampler.step_plan import make_plan

from tests.sampler.helpers import chi2_pvalue
from tests.sampler.test_distribution import PARAMS, VOCAB, _expected, _row
from tests.sampler.test_triton_kernels import make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = torch.device("cuda")


def _top_p_ambiguous(stats: torch.Tensor, survivors: torch.Tensor, top_p: float,
                     tokens: torch.Tensor) -> bool:
    """Whether every token in ``tokens`` sits at the top-p boundary within float32 rounding of
    the cumulative mass: |mass strictly above it / total - p| < 1e-4 (float64 reference)."""
    vals = stats[survivors].double()
    probs = torch.exp(vals - vals.max())
    probs /= probs.sum()
    for t in tokens.tolist():
        above = probs[vals > stats[t].double()].sum().item()
        if abs(above - top_p) >= 1e-4:
            return False
    return True


KEPT_SET_BATCHES = 200


def kept_set_batches(start: int = 0, stop: int = KEPT_SET_BATCHES):
    """The random batches of the kept-set test: (index, sampler, slots, bf16/fp32 logits)."""
    rng = np.random.default_rng(0)
    for b in range(stop):
        rows = int(rng.integers(1, 64))
        vocab = int(rng.choice([1000, 32000, 151936]))
        scale = float(rng.uniform(1, 5))
        if b < start:
            continue
        sampler, slots = make_batch(1000 + b, rows, vocab, max_num_seqs=64)
        dtype = torch.bfloat16 if b % 2 else torch.float32
        logits = (torch.randn(rows, vocab, device=DEV) * scale).to(dtype)
        yield b, sampler, slots, logits


def test_triton_kept_sets_and_tokens_equal_torch_on_200_batches():
    """Kept sets equal the torch oracle's; where they differ it is only a top-p boundary token
    whose strictly-greater mass is within float32 rounding of p (sums in another order).
    Each new kernel specialisation compiles in seconds on the GPU and the batches need ~20:
    ``python -m tests.sampler.prewarm_gpu_kernels`` compiles them ahead in parallel."""
    from sampler.kernels.launcher import run_pipeline_triton
    from sampler.slot_params import TOP_P

    token_mismatch = exact_rows = boundary_rows = 0
    for b, sampler, slots, logits in kept_set_batches():
        rows, vocab = logits.shape
        state = sampler.state
        state.flush()
        plan = make_plan(state, slots)
        idx = torch.as_tensor(slots, dtype=torch.int64, device=DEV)
        processed = logits.to(torch.float32, copy=True)  # never alias the kernel's input
        ref = run_pipeline(processed, idx, state, plan, inplace=True)

        def partial(**off):
            x = logits.to(torch.float32, copy=True)
            sub = plan.__class__(**{**{f: getattr(plan, f) for f in plan.__slots__}, **off,
                                    "modes": frozenset(), "max_num_logprobs": 0})
            run_pipeline(x, idx, state, sub, inplace=True)
            return x
        stats = partial(do_min_p=False, do_top_k=False, do_top_p=False)
        no_top_p = partial(do_top_p=False)
        thresholds = torch.empty(rows, device=DEV)
        out = run_pipeline_triton(logits, idx, state, plan, inplace=False,
                                  thresholds=thresholds)
        random = ~state.is_greedy[idx]
        kept_ref = torch.isfinite(processed) & random[:, None]
        kept_tri = torch.isfinite(stats) & (stats >= thresholds[:, None]) & random[:, None]
        ties = 0  # this batch's boundary rows
        for r in torch.nonzero((kept_ref != kept_tri).any(dim=1)).flatten().tolist():
            diff = torch.nonzero(kept_ref[r] != kept_tri[r]).flatten()
            p = float(state.fparams[idx[r], TOP_P])
            ok = p < 1.0 and _top_p_ambiguous(stats[r], torch.isfinite(no_top_p[r]), p, diff)
            assert ok, (f"batch {b} row {r} (vocab {vocab}, slot {int(idx[r])}): kept "
                        f"{int(kept_ref[r].sum())} (torch) vs {int(kept_tri[r].sum())} "
                        f"(triton), threshold {float(thresholds[r])}, {len(diff)} tokens differ")
            ties += 1
        boundary_rows += ties
        exact_rows += int(random.sum()) - ties
        token_mismatch += int((ref.token_ids != out.token_ids).sum())
        if ref.ranks is not None:
            asked = ref.ranks > 0
            torch.testing.assert_close(out.logprobs[asked], ref.logprobs[asked],
                                       rtol=1e-5, atol=1e-5)
    print(f"random rows with identical kept sets: {exact_rows}; top-p boundary ties: "
          f"{boundary_rows}; tokens differing from torch: {token_mismatch}")
    assert boundary_rows <= 0.01 * max(exact_rows, 1)
    # noise differs from torch's only in the last bits of log/log1p: near-ties at most
    assert token_mismatch <= 2, f"{token_mismatch} tokens differ from the torch backend"


def _draw_gpu(backend: str, slots: int = 10_000, steps: int = 100) -> np.ndarray:
    row = _row().to(DEV)
    sampler = Sampler(slots, VOCAB, device=DEV, eos_token_ids=[0], backend=backend)
    # FlashInfer ignores seeds, so a request that sets one never runs on it: leave it unset
    # (the slot's seed is still given, as the engine derives one for every request)
    params = PARAMS.replace(seed=-1) if backend == "flashinfer" else PARAMS
    for slot in range(slots):
        sampler.add_request(slot, params, [1, 2, 3], seed=derive_seed(7, slot))
    idx = torch.arange(slots, device=DEV)
    counts = torch.zeros(VOCAB, dtype=torch.int64, device=DEV)
    batch = row.expand(slots, VOCAB)
    for _ in range(steps):
        counts += torch.bincount(sampler.sample(batch.clone(), idx).token_ids, minlength=VOCAB)
    if backend == "flashinfer":  # every step was FlashInfer's draw, none fell back
        assert (sampler._run.num_flashinfer_steps, sampler._run.num_fallback_steps) == (steps, 0)
    return counts.cpu().numpy()


@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_million_draws_chi_square(backend):
    """10^6 draws against the oracle. FlashInfer is statistically equal only (its own Philox
    stream, no per-row seeds): this test is what ties it to the spec's distribution."""
    counts = _draw_gpu(backend)
    kept, probs = _expected(PARAMS)
    assert counts.sum() == 1_000_000
    assert counts[~kept].sum() == 0, "a draw outside the kept set"
    p = chi2_pvalue(counts[kept], probs[kept] * counts.sum())
    assert p > 1e-3, f"{backend}: chi-square p = {p}"


def test_triton_seeded_draws_identical_across_batch_compositions():
    vocab = 151936
    target = torch.randn(vocab, device=DEV).to(torch.bfloat16)
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, min_p=0.01, seed=77,
                            repetition_penalty=1.2, logprobs=5)
    results = []
    for rows, slot in ((1, 0), (99, 37), (256, 200)):
        sampler = Sampler(256, vocab, device=DEV, eos_token_ids=[0], backend="triton")
        others = [s for s in range(256) if s != slot][: rows - 1]
        for s in others:
            sampler.add_request(s, SamplingParams(temperature=1.0, top_p=0.8, seed=s), [3],
                                seed=s)
        sampler.add_request(slot, params, [5, 6, 7], seed=77)
        logits = torch.randn(rows, vocab, device=DEV).to(torch.bfloat16)
        logits[-1] = target
        toks = []
        for _ in range(5):
            out = AsyncOutput(sampler.sample(logits, others + [slot])).get()
            toks.append(int(out.token_ids[-1]))
        results.append(toks)
    assert results[0] == results[1] == results[2]


def test_flashinfer_logprobs_equal_torch_for_its_tokens():
    """On a mixed bf16 batch (greedy and random rows, penalties, bias, bad words, min_tokens,
    raw-family logprobs): FlashInfer's tokens lie in the torch oracle's kept sets (greedy rows
    equal torch's), and its logprobs, ranks and top-k equal the torch backend's values for
    those same tokens."""
    from sampler.ops.logprobs import compute_logprob_outputs
    from sampler.pipeline import _raw_values
    from sampler.slot_params import MODE, MODE_CODES, NUM_LOGPROBS, TEMPERATURE

    rows, vocab = 64, 151936
    rng = np.random.default_rng(3)
    modes = ["raw_logprobs", "raw_logits", "temperature_logprobs"]
    fi = Sampler(rows, vocab, device=DEV, eos_token_ids=[0], backend="flashinfer")
    ref = Sampler(rows, vocab, device=DEV, eos_token_ids=[0], backend="torch")
    for slot in range(rows):
        greedy = slot % 4 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else float(rng.choice([0.5, 1.0, 1.3])),
            top_k=int(rng.choice([0, 20, 1000])), top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.02])), repetition_penalty=1.2,
            frequency_penalty=0.3, logit_bias={7: 2.0}, min_tokens=2, stop_token_ids=[1],
            logprobs=int(rng.choice([0, 5, 20])), logprobs_mode=modes[slot % 3])
        prompt = rng.integers(0, vocab, 50).tolist()
        for sampler in (fi, ref):
            sampler.add_request(slot, params, prompt, seed=derive_seed(1, slot),
                                output_token_ids=[5], bad_words_token_ids=[[9], [5, 11]])
    slots = list(range(rows))
    logits = (torch.randn(rows, vocab, device=DEV) * 3).to(torch.bfloat16)
    out = fi.sample(logits, slots)
    assert (fi._run.num_flashinfer_steps, fi._run.num_fallback_steps) == (1, 0)
    processed = logits.float()  # the oracle's processed logits (steps 2-11)
    want = ref.sample(processed, slots)
    greedy = torch.tensor([s % 4 == 0 for s in slots], device=DEV)
    assert torch.equal(out.token_ids[greedy], want.token_ids[greedy])
    kept = torch.isfinite(processed.gather(1, out.token_ids[:, None]))[:, 0]
    assert bool(kept.all()), f"rows {torch.nonzero(~kept).flatten().tolist()} drew a dropped token"
    # the torch pipeline's own logprob tables (raw snapshot of each row's mode), for
    # FlashInfer's tokens
    state, idx = ref.state, torch.arange(rows, device=DEV)
    row_mode = state.iparams[idx, MODE][:, None]
    table = torch.full((rows, vocab), float("nan"), device=DEV)
    for mode in modes:
        code = MODE_CODES[mode]
        values = _raw_values(logits, code, state.fparams[idx, TEMPERATURE], copy=True)
        table = torch.where(row_mode == code, values, table)
    lp, rank, ids, vals = compute_logprob_outputs(table, out.token_ids,
                                                  state.iparams[idx, NUM_LOGPROBS], 20)
    torch.testing.assert_close(out.logprobs, lp, rtol=0, atol=0)
    assert torch.equal(out.ranks, rank) and torch.equal(out.topk_ids, ids)
    torch.testing.assert_close(out.topk_values, vals, rtol=0, atol=0)


@pytest.mark.parametrize("workload", ["full", "greedy_sampled_logprob", "greedy_logprobs"])
def test_candidate_path_on_the_benchmark_workloads(workload):
    """sampler_bench's workloads at 256 rows x 151,936 (bf16): every row settles on the
    candidate path at its GPU launch config (the greedy split off, which all-greedy steps
    without top logprobs take otherwise), and four steps of the stateful Triton sampler (the
    step recorded by its kernels) give the torch sampler's tokens, logprobs, ranks and top
    logprobs."""
    import dataclasses

    from sampler.kernels.kernel_config import launch_config, set_launch_config

    set_launch_config(dataclasses.replace(launch_config(151936), greedy_split=False,
                                          greedy_one=False))
    try:
        _candidate_path_on(workload)
    finally:
        set_launch_config(None)


@pytest.mark.parametrize("workload", ["greedy_sampled_logprob", "greedy"])
def test_greedy_steps_in_one_launch_on_the_benchmark_workloads(workload):
    """The all-greedy benchmark workloads at 256 rows x 151,936 (bf16) at the default launch
    config (one launch a step, each row finished by its last chunk program): four steps of
    the stateful Triton sampler give the torch sampler's tokens, logprobs and ranks."""
    from sampler.kernels.kernel_config import launch_config
    from sampler.kernels.launcher import greedy_one

    probe = Sampler(1, 151936, device=DEV, eos_token_ids=[0])
    probe.add_request(0, SamplingParams(temperature=0.0, logprobs=0), [1], seed=0)
    probe.state.flush()
    assert greedy_one(launch_config(151936), make_plan(probe.state, np.arange(1)))
    _candidate_path_on(workload, check_path=False)


def _candidate_path_on(workload: str, check_path: bool = True) -> None:
    import importlib.util
    import random
    from pathlib import Path

    from sampler.kernels.launcher import run_pipeline_triton
    from tests.sampler.test_triton_kernels import assert_same

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler_bench.py"
    spec = importlib.util.spec_from_file_location("sampler_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows, vocab = 256, 151936
    samplers = [Sampler(rows, vocab, device=DEV, eos_token_ids=[0], max_logprobs=20,
                        backend=b) for b in ("triton", "torch")]
    rng = random.Random(1)
    for slot in range(rows):
        req = bench._workload(workload, slot, vocab, rng)
        for s in samplers:
            s.add_request(slot, req["params"].replace(seed=-1), req.get("prompt", [1, 2, 3]),
                          seed=req["params"].seed, bad_words_token_ids=req.get("bad_words", ()))
    slots = list(range(rows))
    for step in range(4):
        logits = (torch.randn(rows, vocab, device=DEV) * 3).to(torch.bfloat16)
        if step == 0 and check_path:
            state = samplers[0].state
            state.flush()
            scratch: dict = {}
            run_pipeline_triton(logits, torch.arange(rows, device=DEV), state,
                                make_plan(state, np.arange(rows)), inplace=False,
                                scratch=scratch)
            assert (scratch["cand_done"] > 0).all(), scratch["cand_done"]
        out, ref = (s.sample(logits, slots) for s in samplers)
        assert_same(ref, out)
