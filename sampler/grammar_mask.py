"""The grammar masks of one step, as the sampler takes them (``Sampler.sample(token_bitmask=)``).

Only constrained rows carry a mask: ``bits[j]`` (packed, ``ceil(vocab / 32)`` int32 words, bit
``t & 31`` of word ``t >> 5`` set when token ``t`` is allowed) is the mask of logits row
``rows[j]``; ``row_map[r]`` is the mask index of logits row ``r`` or -1 (what a per-row kernel
program reads). A step without constrained rows passes None and pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepBitmask:
    """Packed grammar masks of a step's constrained rows, on the logits' device.

    Attributes:
        bits: ``[num_masked, ceil(vocab / 32)]`` int32.
        rows: ``[num_masked]`` int64, the logits row of each mask (distinct, ascending).
        row_map: ``[num_rows]`` int32, the mask of each logits row, -1 for none.
    """

    bits: torch.Tensor
    rows: torch.Tensor
    row_map: torch.Tensor

    @classmethod
    def build(cls, bits: torch.Tensor, rows_host: np.ndarray, num_rows: int,
              device: torch.device, source: np.ndarray | None = None) -> "StepBitmask":
        """From the masks (already on ``device``) and their logits rows as a host array;
        with ``source``, ``bits`` holds them in other rows: row ``source[j]`` is the mask
        of logits row ``rows_host[j]`` (a row of ``bits`` no row names is left out)."""
        from sampler.state import to_device

        rows_host = np.asarray(rows_host, dtype=np.int64)
        n = rows_host.shape[0]
        assert bits.dtype == torch.int32
        assert bits.shape[0] == n if source is None else len(source) == n
        row_map = np.full(num_rows, -1, dtype=np.int32)
        row_map[rows_host] = np.arange(n, dtype=np.int32)
        parts = [rows_host, row_map.astype(np.int64)]
        if source is not None:
            parts.append(np.asarray(source, dtype=np.int64))
        both = to_device(np.concatenate(parts), device)
        if source is not None:
            bits = bits.index_select(0, both[n + num_rows:])
        return cls(bits, both[:n], both[n:n + num_rows].to(torch.int32))


def check_bitmask(mask: StepBitmask, num_rows: int, vocab: int) -> None:
    """Raises ``ValueError`` naming ``token_bitmask`` when its shapes do not fit the step."""
    if not isinstance(mask, StepBitmask):
        raise ValueError(f"token_bitmask: must be a StepBitmask, got {type(mask).__name__}")
    words = (vocab + 31) // 32
    if mask.bits.dim() != 2 or mask.bits.shape[1] != words or mask.bits.dtype != torch.int32:
        raise ValueError(f"token_bitmask.bits: expected int32 [num_masked, {words}], got "
                         f"{mask.bits.dtype} {tuple(mask.bits.shape)}")
    if mask.rows.shape != (mask.bits.shape[0],) or mask.row_map.shape != (num_rows,):
        raise ValueError(f"token_bitmask: expected rows [{mask.bits.shape[0]}] and row_map "
                         f"[{num_rows}], got {tuple(mask.rows.shape)} and "
                         f"{tuple(mask.row_map.shape)}")
