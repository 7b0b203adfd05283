"""top-k / top-p / min-p kept sets equal the oracle's exactly (docs/sampler.md §2 steps 9–11)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sampler import SamplingParams
from sampler.ops.top_k_top_p import apply_top_k_top_p
from tests.sampler.reference import reference_top_p_keep

from tests.sampler.helpers import oracle_rows, random_logits, run_sampler

NEG_INF = float("-inf")


def _mixed_params(rows: int, vocab: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for r in range(rows):
        out.append(SamplingParams(
            temperature=rng.choice([0.0, 0.3, 1.0, 1.7]),
            top_k=rng.choice([0, 1, 2, 7, vocab - 1, vocab, vocab + 5, rng.randrange(1, vocab)]),
            top_p=rng.choice([1.0, 0.01, 0.5, 0.9, 0.97]),
            min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
            seed=rng.randrange(2**63),
        ))
    return out


def _shape_rows(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Makes some rows 50/90/99% -inf and one row all -inf (batches of 7 and more)."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = logits.shape
    for r, frac in zip(range(1, rows, 2), [0.5, 0.9, 0.99] * rows):
        drop = torch.rand(vocab, generator=g) < frac
        drop[torch.randint(vocab, (1,), generator=g)] = False  # at least one survivor
        logits[r, drop] = NEG_INF
    if rows >= 7:
        logits[rows // 2 + (rows // 2) % 2] = NEG_INF  # an even row: all -inf
    return logits


SIZES = [(1, 111), (7, 111), (99, 111), (1, 32000), (7, 32000), (99, 32000), (1, 151936),
         (7, 151936)]


@pytest.mark.parametrize("rows,vocab", SIZES)
@pytest.mark.parametrize("ties", [False, True])
def test_kept_sets_and_tokens_match_oracle(rows, vocab, ties):
    seed = rows * 1000 + vocab + ties
    logits = _shape_rows(random_logits(rows, vocab, seed, ties=ties), seed)
    params = _mixed_params(rows, vocab, seed)
    out, processed = run_sampler(logits, params, slots=random.Random(seed).sample(range(2 * rows), rows))
    check = range(rows) if vocab < 100_000 or rows <= 7 else random.Random(seed).sample(range(rows), 5)
    check = list(check)[:40]
    oracle = oracle_rows(logits[check], [params[r] for r in check])
    for res, r in zip(oracle, check):
        assert torch.equal(torch.isfinite(processed[r]), torch.from_numpy(res.kept)), r
        assert torch.equal(processed[r], torch.from_numpy(res.processed)), r
        assert out.token_ids[r].item() == res.token_id, r
    assert not processed.isnan().any()


def test_big_batch_big_vocab_rows_match_oracle():
    rows, vocab = 99, 151936
    logits = _shape_rows(random_logits(rows, vocab, 5), 5)
    params = _mixed_params(rows, vocab, 5)
    out, processed = run_sampler(logits, params)
    check = [0, 1, 49, 50, 98]
    for res, r in zip(oracle_rows(logits[check], [params[r] for r in check]), check):
        assert torch.equal(processed[r], torch.from_numpy(res.processed)), r
        assert out.token_ids[r].item() == res.token_id


def _apply(x, k=0, p=1.0):
    x = x.clone()[None, :] if x.dim() == 1 else x.clone()
    rows = x.shape[0]
    apply_top_k_top_p(x, torch.arange(rows), torch.full((rows,), k), torch.full((rows,), p))
    return x


def test_top_k_keeps_ties_at_the_boundary():
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 0.5])
    assert torch.isfinite(_apply(x, k=1))[0].tolist() == [0, 1, 0, 1, 0, 0]
    assert torch.isfinite(_apply(x, k=2))[0].tolist() == [0, 1, 0, 1, 0, 0]
    assert torch.isfinite(_apply(x, k=3))[0].tolist() == [0, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("vocab", [111, 32000])
def test_top_k_extremes(vocab):
    x = random_logits(3, vocab, 11)
    assert torch.equal(_apply(x, k=vocab), x)
    assert torch.equal(_apply(x, k=vocab + 3), x)
    assert torch.equal(_apply(x, k=0), x)
    kept = torch.isfinite(_apply(x, k=vocab - 1))
    assert kept.sum(-1).tolist() == [vocab - 1] * 3
    assert not kept.gather(1, x.argmin(-1, keepdim=True)).any()
    one = torch.isfinite(_apply(x, k=1))
    assert one.sum(-1).tolist() == [1] * 3 and one.gather(1, x.argmax(-1, keepdim=True)).all()


def test_top_p_hand_made_ties():
    # probabilities 0.4, 0.2, 0.2, 0.2 (and a dropped token)
    x = torch.tensor([math.log(0.4), math.log(0.2), math.log(0.2), math.log(0.2), NEG_INF])
    assert torch.isfinite(_apply(x, p=0.3))[0].tolist() == [1, 0, 0, 0, 0]
    # 0.4 < 0.5: the whole 0.2 tie group is kept although 0.4 + 0.2 > 0.5
    assert torch.isfinite(_apply(x, p=0.5))[0].tolist() == [1, 1, 1, 1, 0]
    for p in (0.3, 0.5):
        keep = reference_top_p_keep(x.numpy(), p)
        assert keep.tolist() == torch.isfinite(_apply(x, p=p))[0].tolist()


def test_top_p_mass_exactly_p_is_not_kept():
    # e = exp(x - max) = 1, 0.5, 0.5, 0.5 exactly: mass above the 0.5 group is 1 / 2.5 = 0.4
    half = -torch.log(torch.tensor(2.0))
    x = torch.stack([torch.tensor(0.0), half, half, half])
    assert torch.exp(half).item() == 0.5
    assert torch.isfinite(_apply(x, p=0.4))[0].tolist() == [1, 0, 0, 0]  # 0.4 < 0.4 is false
    assert torch.isfinite(_apply(x, p=0.41))[0].tolist() == [1, 1, 1, 1]
    assert reference_top_p_keep(x.numpy(), 0.4).tolist() == [1, 0, 0, 0]
    assert reference_top_p_keep(x.numpy(), 0.41).tolist() == [1, 1, 1, 1]


def test_top_p_extremes():
    x = random_logits(4, 32000, 3)
    x[0, :10] = 20.0  # ten tied top tokens
    low = torch.isfinite(_apply(x, p=0.01))
    assert low[0].sum() == 10 and low[0, :10].all()
    assert low[1:].sum(-1).tolist() == [1, 1, 1]
    wide = x.clone()
    wide[:, 0] = 0.0
    wide[:, 1:] = -200.0  # exp underflows to 0 in float32: p = 1 still keeps everything
    assert torch.equal(_apply(wide, p=1.0), wide)
    assert torch.isfinite(_apply(wide, p=0.999999)).sum(-1).tolist() == [1] * 4


def test_all_neg_inf_rows_untouched():
    x = torch.full((3, 111), NEG_INF)
    for k, p in [(5, 0.5), (0, 0.3), (1, 1.0)]:
        y = _apply(x, k=k, p=p)
        assert torch.isneginf(y).all() and not y.isnan().any()
    params = [SamplingParams(temperature=0.7, top_k=3, top_p=0.4, min_p=0.2, seed=1)]
    out, processed = run_sampler(x[:1], params)
    assert torch.isneginf(processed).all()


def test_min_p_rule():
    x = torch.tensor([[0.0, math.log(0.5), math.log(0.1) + 1e-4, math.log(0.1) - 1e-4, NEG_INF]])
    params = [SamplingParams(temperature=1.0, min_p=0.1, seed=3)]
    _, processed = run_sampler(x, params)
    assert torch.isfinite(processed)[0].tolist() == [True, True, True, False, False]
    [res] = oracle_rows(x, params)
    assert res.kept.tolist() == [True, True, True, False, False]


def test_order_min_p_then_top_k_then_top_p():
    # min-p drops the tail first; top-k counts only survivors' values; top-p renormalises
    # after top-k: with k = 2 the two survivors have masses 0.5 / 0.5 -> p = 0.4 keeps one.
    x = torch.tensor([[2.0, 2.0 - math.log(1.0001), 0.0, -5.0]])
    params = [SamplingParams(temperature=1.0, min_p=0.01, top_k=2, top_p=0.4, seed=0)]
    _, processed = run_sampler(x, params)
    assert torch.isfinite(processed)[0].tolist() == [True, False, False, False]
    [res] = oracle_rows(x, params)
    assert res.kept.tolist() == [True, False, False, False]
    params = [SamplingParams(temperature=1.0, min_p=0.01, top_k=2, top_p=0.6, seed=0)]
    _, processed = run_sampler(x, params)
    assert torch.isfinite(processed)[0].tolist() == [True, True, False, False]


def test_partial_topk_path_equals_sort_path():
    x = random_logits(9, 1000, 8, ties=True)
    k = torch.tensor([1, 2, 3, 50, 0, 1000, 1005, 7, 13])  # 0 and >= vocab are off
    a, b = x.clone(), x.clone()
    apply_top_k_top_p(a, torch.arange(9), k, torch.ones(9), do_top_p=False, max_top_k=50)
    apply_top_k_top_p(b, torch.arange(9), k, torch.ones(9), do_top_p=False, max_top_k=None)
    assert torch.equal(a, b)
    assert torch.equal(a[4:7], x[4:7])
    assert (torch.isfinite(a[:4]).sum(-1) >= torch.tensor([1, 2, 3, 50])).all()


def test_mixed_rows_do_not_affect_each_other():
    vocab = 500
    logits = random_logits(7, vocab, 21, ties=True)
    params = _mixed_params(7, vocab, 21)
    out, processed = run_sampler(logits, params)
    for r in range(7):
        alone, proc = run_sampler(logits[r:r + 1], params[r:r + 1])
        assert torch.equal(proc[0], processed[r]) and alone.token_ids[0] == out.token_ids[r]


def test_kept_set_never_empty_and_contains_argmax():
    vocab = 111
    logits = random_logits(99, vocab, 4, ties=True)
    params = _mixed_params(99, vocab, 4)
    _, processed = run_sampler(logits, params)
    kept = torch.isfinite(processed)
    assert kept.any(-1).all()
    assert kept.gather(1, logits.argmax(-1, keepdim=True)).all()
