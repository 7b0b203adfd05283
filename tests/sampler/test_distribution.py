"""10^6 draws from one row vs the oracle's renormalised probabilities (docs/sampler.md §5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampler import Sampler, SamplingParams, derive_seed

from tests.sampler.helpers import chi2_pvalue, oracle_rows

VOCAB = 64
SLOTS = 1000


def _row() -> torch.Tensor:
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(VOCAB, generator=g) * 2.0
    x[5] = x[6] = x.max() + 0.25  # a tie at the top
    return x


def _draw(params: SamplingParams, steps: int, precision: str) -> np.ndarray:
    """``steps * SLOTS`` draws of the same row: every slot its own seed, every step a new
    output position, so each draw uses its own noise."""
    row = _row()
    sampler = Sampler(SLOTS, VOCAB, device="cpu", eos_token_ids=[0], noise_precision=precision)
    for slot in range(SLOTS):
        sampler.add_request(slot, params, [1, 2, 3], seed=derive_seed(99, slot))
    slots = list(range(SLOTS))
    counts = np.zeros(VOCAB, dtype=np.int64)
    batch = row.expand(SLOTS, VOCAB)
    for _ in range(steps):
        out = sampler.sample(batch.clone(), slots)
        counts += np.bincount(out.token_ids.numpy(), minlength=VOCAB)
    return counts


def _expected(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    [res] = oracle_rows(_row()[None, :], [params])
    kept = res.kept
    probs = np.zeros(VOCAB)
    logits = res.processed[kept].astype(np.float64)
    probs[kept] = np.exp(logits - logits.max())
    return kept, probs / probs.sum()


PARAMS = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, min_p=0.005, seed=1)


@pytest.fixture(scope="module")
def million_draws() -> np.ndarray:
    return _draw(PARAMS, 1000, "fp32")


def test_every_filter_bites():
    [res] = oracle_rows(_row()[None, :], [PARAMS.replace(top_k=0, top_p=1.0)])
    after_min_p = int(res.kept.sum())
    [res] = oracle_rows(_row()[None, :], [PARAMS.replace(top_p=1.0)])
    after_top_k = int(res.kept.sum())
    kept, _ = _expected(PARAMS)
    assert VOCAB > after_min_p > after_top_k > int(kept.sum()) >= 15


def test_one_million_draws_match_oracle_probabilities(million_draws):
    kept, probs = _expected(PARAMS)
    counts = million_draws
    assert counts.sum() == 1_000_000
    assert counts[~kept].sum() == 0, "a draw left the kept set"
    assert chi2_pvalue(counts[kept], probs[kept] * counts.sum()) > 1e-3


def test_fp64_noise_matches_oracle_probabilities():
    kept, probs = _expected(PARAMS)
    counts = _draw(PARAMS, 150, "fp64")
    assert counts[~kept].sum() == 0
    assert chi2_pvalue(counts[kept], probs[kept] * counts.sum()) > 1e-3


def test_chi_square_detects_a_wrong_distribution(million_draws):
    # the same draws judged against a slightly different temperature must fail: the test has power
    kept, _ = _expected(PARAMS)
    _, wrong = _expected(PARAMS.replace(temperature=1.35))
    counts = million_draws
    assert chi2_pvalue(counts[kept], wrong[kept] * counts.sum()) < 1e-3
