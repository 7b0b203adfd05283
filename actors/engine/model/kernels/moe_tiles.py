"""The tiles of the routed experts' grouped GEMMs (:mod:`actors.engine.model.kernels.moe_gemm`):
a configuration, and the table that picks one by the pairs per expert of a call."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TILE_TABLE", "TileConfig", "pick_config"]


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Rows per block (shared by the sort and both GEMMs), row blocks per group of the tile
    order, and each GEMM's ``(block_n, block_k, num_warps, num_stages)``. ``swap``: the GEMMs
    compute their tiles transposed (the weights the MMA's row operand, a block's rows its
    columns); ``tma``: the swapped GEMMs read the weights through tensor descriptors (Hopper's
    bulk copies), where the layout allows it
    (:func:`actors.engine.model.kernels.moe_gemm.tma_layout`)."""

    block_m: int
    group_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]
    swap: bool = False
    tma: bool = False


#: (max pairs per expert, tiles), first match. Decode batches get one or two row blocks per
#: expert, so each expert's weights are read about once; the gate/up GEMM holds two
#: accumulators (gate and up) of ``block_m x block_n``. From ~32 pairs an expert the GEMMs run
#: transposed with the weights read through descriptors: the fastest of a sweep on an H200
#: (Qwen3-30B-A3B's experts, one layer at 512 and 1,024 rows: docs/benchmarks.md, MoE, run
#: CI). Prefill takes 128-row blocks, grouped by 8 (about one expert's rows at a 16k-token
#: step) so rows and weights come from L2.
TILE_TABLE: tuple[tuple[int | None, TileConfig], ...] = (
    (12, TileConfig(16, 8, (64, 128, 4, 4), (128, 128, 4, 4))),
    (48, TileConfig(64, 8, (64, 64, 4, 3), (128, 64, 4, 4), swap=True, tma=True)),
    (64, TileConfig(64, 8, (64, 64, 4, 3), (128, 64, 4, 3), swap=True, tma=True)),
    (None, TileConfig(128, 8, (64, 64, 8, 3), (128, 64, 8, 4))),
)


def pick_config(num_pairs: int, num_experts: int) -> TileConfig:
    """The tile configuration for ``num_pairs`` (token, expert) pairs over the experts."""
    per_expert = num_pairs / max(num_experts, 1)
    for bound, config in TILE_TABLE:
        if bound is None or per_expert <= bound:
            return config
    raise AssertionError("the last entry has no bound")
