"""The counter-based noise: the documented hash, uniform bits, tail-accurate Gumbel values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from sampler.ops.gumbel import (
    compute_gumbel_noise,
    compute_hash_bits,
    compute_row_keys,
    gumbel_from_bits,
)

M = 0xFFFFFFFF
LANES = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)


# An independent pure-Python transcription of the module docstring's hash.
def _r1(x: int) -> int:
    return ((x ^ (x >> 16)) * 0x21F0AAAD) & M


def _r2(x: int) -> int:
    y = ((x ^ (x >> 15)) * 0x735A2D97) & M
    return y ^ (y >> 15)


def _key(seed: int, position: int, sample_index: int, lane: int) -> int:
    a = _r2(_r1(LANES[lane] ^ (seed & M)))
    a = _r2(_r1(a ^ (seed >> 32)))
    a = _r2(_r1(a ^ (sample_index & M)))
    return _r2(_r1(a ^ (position & M)))


def _bits(seed: int, position: int, sample_index: int, token: int, fp64: bool) -> int:
    k = [_key(seed, position, sample_index, lane) for lane in range(4 if fp64 else 2)]
    h1 = _r2(_r1((token + k[0]) & M) ^ k[1])
    if not fp64:
        return h1
    return (h1 << 21) | (_r2(_r1((token + k[2]) & M) ^ k[3]) >> 11)


def _python_gumbel(b: int, n: int) -> float:
    if b < 2 ** (n - 1):
        e = -math.log((2 * b + 1) * 2.0 ** -(n + 1))
    else:
        e = -math.log1p(-(2 * (2**n - 1 - b) + 1) * 2.0 ** -(n + 1))
    return -math.log(e)


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_hash_matches_documented_definition(precision):
    rng = random.Random(5)
    fp64 = precision == "fp64"
    rows = [(2**63 - 1, 0, 0), (0, 0, 0), (12345, 2**31 + 7, 3)] + [
        (rng.randrange(2**63), rng.randrange(2**20), rng.randrange(16)) for _ in range(5)
    ]
    vocab = 151936
    seeds, pos, sidx = (torch.tensor(c) for c in zip(*rows))
    keys = compute_row_keys(seeds, pos, sidx, 4 if fp64 else 2)
    bits = compute_hash_bits(keys, vocab, precision)
    for r, (s, p, j) in enumerate(rows):
        for t in [0, 1, 2, vocab - 1] + rng.sample(range(vocab), 20):
            assert bits[r, t].item() == _bits(s, p, j, t, fp64), (r, t)


def test_noise_values_follow_the_documented_formula():
    bits = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 123456789])
    g32 = gumbel_from_bits(bits, "fp32")
    g64 = gumbel_from_bits(bits, "fp64")
    for b, a32 in zip(bits.tolist(), g32.tolist()):
        assert a32 == pytest.approx(_python_gumbel(b, 32), rel=2e-6, abs=2e-6)
    bits53 = torch.tensor([0, 2**52 - 1, 2**52, 2**53 - 1, 987654321987])
    for b, a64 in zip(bits53.tolist(), gumbel_from_bits(bits53, "fp64").tolist()):
        assert a64 == pytest.approx(_python_gumbel(b, 53), rel=1e-12, abs=1e-12)
    assert g64.dtype == torch.float64 and g32.dtype == torch.float32


def test_tail_noise_reaches_far_beyond_naive_float32():
    # naive float32 noise (u rounded to float32) caps g near 16.6 (u <= 1 - 2**-24);
    # the exact 1 - u keeps resolving down to 2**-33 (g up to 33 ln 2 ~ 22.9)
    top32 = gumbel_from_bits(torch.tensor([2**32 - 1]), "fp32").item()
    assert top32 == pytest.approx(33 * math.log(2), rel=1e-5)
    top64 = gumbel_from_bits(torch.tensor([2**53 - 1]), "fp64").item()
    assert top64 == pytest.approx(54 * math.log(2), rel=1e-9)
    assert gumbel_from_bits(torch.tensor([0]), "fp32").item() > -3.2
    # strictly increasing over the whole upper range: no two bit patterns collapse
    upper = torch.arange(2**32 - 4096, 2**32, dtype=torch.int64)
    g = gumbel_from_bits(upper, "fp32")
    assert torch.isfinite(g).all() and (g[1:] > g[:-1]).all()


def test_row_is_a_bijection_of_tokens():
    keys = compute_row_keys(torch.tensor([7, 2**62]), torch.tensor([3, 0]), torch.tensor([0, 9]))
    bits = compute_hash_bits(keys, 151936)
    for row in bits:
        assert row.unique().numel() == row.numel()


def test_bits_are_uniform_and_independent_across_positions():
    positions = torch.arange(2000)
    keys = compute_row_keys(torch.full((2000,), 42), positions, torch.zeros(2000, dtype=torch.int64))
    bits = compute_hash_bits(keys, 500).numpy()  # 10^6 values
    for shift in (24, 0):  # high and low byte
        byte = (bits >> shift) & 0xFF
        assert stats.chisquare(np.bincount(byte.ravel(), minlength=256)).pvalue > 1e-3
    # pairs (position p, position p+1) of the same token: 16 x 16 contingency
    hi = bits >> 28
    pair = (hi[:-1] * 16 + hi[1:]).ravel()
    assert stats.chisquare(np.bincount(pair, minlength=256)).pvalue > 1e-3
    # neighbouring tokens of one row
    pair = (hi[:, :-1] * 16 + hi[:, 1:]).ravel()
    assert stats.chisquare(np.bincount(pair, minlength=256)).pvalue > 1e-3


def test_noise_is_gumbel_distributed():
    g = compute_gumbel_noise(torch.arange(1000) * 7919, torch.zeros(1000, dtype=torch.int64),
                             torch.zeros(1000, dtype=torch.int64), 1000)
    assert stats.kstest(g.numpy().ravel(), "gumbel_r").pvalue > 1e-3
    g64 = compute_gumbel_noise(torch.arange(100), torch.ones(100, dtype=torch.int64),
                               torch.zeros(100, dtype=torch.int64), 1000, "fp64")
    assert stats.kstest(g64.numpy().ravel(), "gumbel_r").pvalue > 1e-3


def test_every_key_component_changes_the_stream():
    base = dict(seeds=torch.tensor([11]), positions=torch.tensor([4]),
                sample_indices=torch.tensor([0]))
    ref = compute_gumbel_noise(**base, vocab_size=1000)
    for name, value in [("seeds", 12), ("seeds", 11 + 2**32), ("positions", 5),
                        ("sample_indices", 1)]:
        changed = compute_gumbel_noise(**{**base, name: torch.tensor([value])}, vocab_size=1000)
        assert (changed != ref).float().mean() > 0.99, name
