"""Launch configuration and shared constants of the sampler's Triton kernels (the leaf of
:mod:`sampler.kernels`: it imports no other module of the package).

:class:`LaunchConfig` holds the tile sizes and switches of every kernel; :func:`launch_config`
picks it (a small one under TRITON_INTERPRET=1, where every op runs in Python), and
:func:`set_launch_config` forces one (benchmarks sweep it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_CAP = 1024  # longest candidate list (top-k / top-p boundary, top-k logprobs)
NUM_BINS = 16  # histogram bins of a refinement pass
MAX_PASSES = 48  # bound on refinement passes; typical rows need 2-6
FIRST_BIN_WIDTH = 0.5

# per-row record of the candidate path, read by the rank kernel (float32 fields): the raw
# and temperature log-sum-exps
REC_WIDTH: tl.constexpr = tl.constexpr(8)
REC_LSE_R: tl.constexpr = tl.constexpr(2)
REC_LSE_T: tl.constexpr = tl.constexpr(3)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tile sizes, warps and switches of the kernels (per vocab size; tunable by the
    benchmark)."""

    # the fused kernel: tiles of `block` tokens (`vec` a thread), candidate lists of `cap`
    block: int = 4096
    num_warps: int = 16
    cap: int = 256
    vec: int = 8
    hist: bool = True  # bin counts through tl.histogram (else per-lane sums)
    skip: bool = True  # the full sampling pass skips tiles with nothing kept
    fast: bool = True  # top-k alone / top-p alone: draw over the min-p survivors, then verify
    # all-greedy steps without top-k logprobs: pass 1 over vocab chunks of `chunk` tokens
    # (tiles of `chunk_block`, `chunk_warps` warps), then the fused kernel at that size only
    # combines them (token, logprob, rank); off: the fused kernel alone
    greedy_split: bool = True
    chunk: int = 16384
    chunk_block: int = 1024
    chunk_warps: int = 4
    # all-greedy steps of unprocessed logits without top-k logprobs: one launch (the candidate
    # path's statistics kernel, whose last program of a row finishes it); before the greedy
    # split and the candidate path
    greedy_one: bool = True
    # the row-pass loops request the logits of the tile this many iterations ahead (0, 1, 2)
    # before processing the current one
    prefetch: int = 1
    # the candidate path (sampler.kernels.candidate_stats, candidate_finish) for greedy rows
    # and rows with top-k (and top logprobs) up to `cand_kmax`, the fused kernel only for the
    # other rows and the rows it leaves: vocab chunks of `cand_chunk` tokens read in tiles of
    # `cand_block` by `cand_warps` warps (`cand_vec` tokens a thread and tile row), candidate
    # lists of `cand_cap` entries (a power of two), touched lists of `cand_tcap`
    cand: bool = True
    cand_chunk: int = 32768
    cand_block: int = 1024
    cand_warps: int = 4
    cand_vec: int = 8
    cand_cap: int = 1024
    cand_tcap: int = 4096
    cand_kmax: int = 64
    cand_finish_warps: int = 4
    # statistics kernel: selected cells a chunk (more: the row falls back), touch words
    # expanded at a time
    cand_cellcap: int = 256
    cand_gw: int = 32


_config_override: LaunchConfig | None = None


def set_launch_config(config: LaunchConfig | None) -> None:
    """Forces a launch config (benchmarks sweep it); None restores the default choice."""
    global _config_override
    _config_override = config


def launch_config(vocab: int) -> LaunchConfig:
    """The launch config for a vocab size (the forced one if set)."""
    if _config_override is not None:
        return _config_override
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter runs every op in Python
        return LaunchConfig(block=min(4096, max(64, triton.next_power_of_2(vocab))),
                            num_warps=4, cap=64, cand_chunk=1024, cand_block=256, cand_vec=4,
                            cand_cap=512, cand_tcap=256)
    return LaunchConfig()


_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element zero tensor standing for a table that the launched specialisation never
    reads or writes (made once per device and dtype: no fill kernel per step)."""
    key = (device, dtype)
    tensor = _PLACEHOLDERS.get(key)
    if tensor is None:
        tensor = _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return tensor
