"""Counter-based Gumbel noise and the final draw (pipeline step 12; greedy rows: step 7).

A row's noise depends only on (seed, output position, sample index, token id), never on the
batch, so a draw is the same alone, in any batch, in any slot and in any process. The hash and
the map from bits to noise: docs/sampler_kernels.md (Noise).
"""

from __future__ import annotations

from typing import Literal

import torch

NoisePrecision = Literal["fp32", "fp64"]

M32 = 0xFFFFFFFF
MUL_A = 0x21F0AAAD
MUL_B = 0x735A2D97
LANE_CONSTANTS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
# rows * vocab elements handled at once: bounds the int64 temporaries of the hash.
CHUNK_ELEMENTS = 1 << 23


def _round1_(x: torch.Tensor) -> torch.Tensor:
    """``R1`` in place on an int64 tensor of 32-bit values. The int64 product of two 32-bit
    values wraps modulo 2**64, which keeps its low 32 bits exact; the mask keeps those."""
    x.bitwise_xor_(x >> 16).mul_(MUL_A).bitwise_and_(M32)
    return x


def _round2_(x: torch.Tensor) -> torch.Tensor:
    """``R2`` in place on an int64 tensor of 32-bit values."""
    x.bitwise_xor_(x >> 15).mul_(MUL_B).bitwise_and_(M32)
    x.bitwise_xor_(x >> 15)
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The two-round 32-bit mixer ``mix`` of the module docstring (int64 in, int64 out)."""
    return _round2_(_round1_(x.clone()))


def compute_row_keys(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    sample_indices: torch.Tensor,
    num_lanes: int = 2,
) -> torch.Tensor:
    """Per-row hash keys from (seed, output position, sample index).

    Args:
        seeds: ``[rows]`` int64, each in ``[0, 2**63)``.
        positions: ``[rows]`` int64 output positions (number of tokens already generated).
        sample_indices: ``[rows]`` int64 sample index (which of the n samples).
        num_lanes: 2 for fp32 noise, 4 for fp64 noise.

    Returns:
        ``[rows, num_lanes]`` int64 keys, each in ``[0, 2**32)``.
    """
    if num_lanes not in (2, 4):
        raise ValueError(f"num_lanes: must be 2 or 4, got {num_lanes}")
    seeds = seeds.to(torch.int64)
    seed_lo = seeds & M32
    seed_hi = (seeds >> 32) & M32
    sidx = sample_indices.to(torch.int64) & M32
    pos = positions.to(torch.int64) & M32
    keys = []
    for lane in range(num_lanes):
        a = mix32(seed_lo ^ LANE_CONSTANTS[lane])
        a = mix32(a ^ seed_hi)
        a = mix32(a ^ sidx)
        keys.append(mix32(a ^ pos))
    return torch.stack(keys, dim=1)


def compute_hash_bits(
    keys: torch.Tensor, vocab_size: int, precision: NoisePrecision = "fp32"
) -> torch.Tensor:
    """The per-token random bits ``b`` of every (row, token).

    Args:
        keys: ``[rows, lanes]`` int64 row keys from :func:`compute_row_keys` (2 lanes for
            fp32, 4 for fp64).
        vocab_size: number of tokens per row.
        precision: "fp32" (32 bits per token) or "fp64" (53 bits per token).

    Returns:
        ``[rows, vocab_size]`` int64 bits in ``[0, 2**32)`` or ``[0, 2**53)``.
    """
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :]

    def h(ka: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
        x = (tokens + ka[:, None]).bitwise_and_(M32)
        return _round2_(_round1_(x).bitwise_xor_(kb[:, None]))

    bits = h(keys[:, 0], keys[:, 1])
    if precision == "fp32":
        return bits
    if precision != "fp64":
        raise ValueError(f"precision: must be 'fp32' or 'fp64', got {precision!r}")
    if keys.shape[1] < 4:
        raise ValueError("keys: fp64 noise needs 4 key lanes")
    return (bits << 21) | (h(keys[:, 2], keys[:, 3]) >> 11)


def gumbel_from_bits(bits: torch.Tensor, precision: NoisePrecision = "fp32") -> torch.Tensor:
    """Gumbel noise ``g = -log(E)`` from hash bits, with the tail-accurate ``E`` (docstring).

    Args:
        bits: int64 tensor of 32-bit (fp32) or 53-bit (fp64) values.
        precision: "fp32" or "fp64"; sets both the bit width and the result dtype.

    Returns:
        Tensor of the shape of ``bits``, float32 or float64.
    """
    n = 32 if precision == "fp32" else 53
    dtype = torch.float32 if precision == "fp32" else torch.float64
    scale = 2.0 ** -(n + 1)
    low = bits < (1 << (n - 1))
    u = (2 * bits + 1).to(dtype) * scale  # exact where it matters (u < 1/2)
    one_minus_u = (2 * ((1 << n) - 1 - bits) + 1).to(dtype) * scale  # exact for u >= 1/2
    e = torch.where(low, -torch.log(u), -torch.log1p(-one_minus_u))
    return -torch.log(e)


def compute_gumbel_noise(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    sample_indices: torch.Tensor,
    vocab_size: int,
    precision: NoisePrecision = "fp32",
) -> torch.Tensor:
    """Gumbel noise for whole rows.

    Args:
        seeds, positions, sample_indices: ``[rows]`` int64 (see :func:`compute_row_keys`).
        vocab_size: tokens per row.
        precision: "fp32" (default) or "fp64".

    Returns:
        ``[rows, vocab_size]`` float32 (or float64) noise.

    Example:
        >>> g = compute_gumbel_noise(torch.tensor([7]), torch.tensor([0]), torch.tensor([0]), 5)
        >>> g.shape
        torch.Size([1, 5])
    """
    keys = compute_row_keys(seeds, positions, sample_indices, 2 if precision == "fp32" else 4)
    return gumbel_from_bits(compute_hash_bits(keys, vocab_size, precision), precision)


def compute_sampled_ids(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    sample_indices: torch.Tensor,
    *,
    any_greedy: bool = True,
    any_random: bool = True,
    precision: NoisePrecision = "fp32",
) -> torch.Tensor:
    """Draws one token per row: argmax for greedy rows, Gumbel-max for the others.

    Args:
        logits: ``[rows, vocab]`` float32 processed logits (masked tokens are -inf).
        idx_mapping: ``[rows]`` int64, the slot of each row.
        is_greedy: ``[max_num_seqs]`` bool per slot.
        seeds, positions, sample_indices: ``[max_num_seqs]`` int64 per slot.
        any_greedy, any_random: host-side predicates; when one is False its path is skipped
            (the all-random and all-greedy fast paths).
        precision: noise precision, "fp32" or "fp64".

    Returns:
        ``[rows]`` int64 token ids. Greedy ties go to the lowest id; a row that is all -inf
        returns id 0.
    """
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if not (any_greedy or any_random):  # no host knowledge: take both paths
        any_greedy = any_random = True
    greedy_ids = logits.argmax(dim=-1) if any_greedy else None
    if not any_random:
        return greedy_ids
    seeds_r, pos_r, sidx_r = seeds[idx_mapping], positions[idx_mapping], sample_indices[idx_mapping]
    chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    parts = []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        noise = compute_gumbel_noise(
            seeds_r[start:stop], pos_r[start:stop], sidx_r[start:stop], vocab, precision
        )
        scores = noise.add_(logits[start:stop].to(noise.dtype))
        parts.append(scores.argmax(dim=-1))
    random_ids = parts[0] if len(parts) == 1 else torch.cat(parts)
    if not any_greedy:
        return random_ids
    return torch.where(is_greedy[idx_mapping], greedy_ids, random_ids)
