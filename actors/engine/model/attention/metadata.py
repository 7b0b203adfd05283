"""Per-step attention metadata: what every backend needs to write and read the paged KV cache.

Built once per step by the model runner (host arrays first, then one copy to the device) and
handed to the backend's ``plan``. Token order is the packed order of the step: the scheduled
sequences one after another, each contributing its ``query_len`` new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of one packed step.

    Attributes:
        num_seqs: B, sequences in the step.
        num_tokens: T, packed new tokens.
        max_query_len: longest chunk of new tokens.
        max_seq_len: longest context after the step (cached + new).
        query_start_loc: ``[B+1]`` int32, cumulative query lengths (device).
        seq_lens: ``[B]`` int32, context length after the step (device).
        block_tables: ``[B, max_blocks]`` int32 page ids, padded with 0 (device).
        slot_mapping: ``[T]`` int64, ``page * block_size + offset`` of each new token (device).
        positions: ``[T]`` int64, position of each new token in its sequence (device).
        query_start_loc_host, seq_lens_host, block_tables_host: the same, as numpy arrays
            (backends that plan on the host, such as FlashInfer, read these).
        block_size: tokens per page.
    """

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    query_start_loc_host: np.ndarray
    seq_lens_host: np.ndarray
    block_tables_host: np.ndarray
    block_size: int

    @property
    def query_lens_host(self) -> np.ndarray:
        return np.diff(self.query_start_loc_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
