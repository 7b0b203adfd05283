"""Host-side page tables in FlashInfer's CSR form (numpy only; no device work).

A step's block tables ``[B, max_blocks]`` become ``indptr [B+1]`` (int32), ``indices [nnz]``
(the pages each sequence uses, in order) and ``last_page_len [B]`` (tokens in each sequence's
last page, 1..block_size). Decode steps padded to a CUDA-graph bucket append one row per
padding slot that uses a single scratch page holding one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PagedCSR:
    """The page table of one step in CSR form (host arrays, int32)."""

    indptr: np.ndarray         # [B+1]
    indices: np.ndarray        # [indptr[-1]]
    last_page_len: np.ndarray  # [B]
    kv_lens: np.ndarray        # [B] keys each row attends over (the context after the step)

    @property
    def num_rows(self) -> int:
        return len(self.last_page_len)


def build_csr(seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
              *, pad_to: int = 0, scratch_page: int = -1) -> PagedCSR:
    """CSR page table of ``B`` sequences, optionally padded with scratch rows.

    Args:
        seq_lens: ``[B]`` context length of each sequence after the step (>= 1).
        block_tables: ``[B, max_blocks]`` page ids; entries past a sequence's pages are ignored.
        block_size: tokens per page.
        pad_to: total rows wanted (>= B); rows ``B..pad_to-1`` use ``scratch_page`` (1 token).
        scratch_page: the page of the padding rows (required when ``pad_to > B``).

    Returns:
        The :class:`PagedCSR` of ``max(B, pad_to)`` rows.

    Example:
        >>> csr = build_csr(np.array([5, 1]), np.array([[7, 2], [4, 0]]), 4)
        >>> csr.indptr.tolist(), csr.indices.tolist(), csr.last_page_len.tolist()
        ([0, 2, 3], [7, 2, 4], [1, 1])
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_seqs = len(seq_lens)
    num_pad = max(0, pad_to - num_seqs)
    if num_pad and scratch_page < 0:
        raise ValueError("scratch_page: required when padding rows are added")
    num_pages = (seq_lens + block_size - 1) // block_size               # [B]
    width = block_tables.shape[1] if block_tables.ndim == 2 else 0
    if num_seqs and int(num_pages.max()) > width:
        raise ValueError(f"block_tables: {width} columns, a sequence needs {num_pages.max()}")
    keep = np.arange(width)[None, :] < num_pages[:, None]               # [B, max_blocks]
    indices = block_tables[keep].astype(np.int32)
    last = (seq_lens - 1) % block_size + 1
    kv_lens = seq_lens
    if num_pad:
        indices = np.concatenate([indices, np.full(num_pad, scratch_page, np.int32)])
        num_pages = np.concatenate([num_pages, np.ones(num_pad, np.int64)])
        last = np.concatenate([last, np.ones(num_pad, np.int64)])
        kv_lens = np.concatenate([kv_lens, np.ones(num_pad, np.int64)])
    indptr = np.zeros(len(num_pages) + 1, np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    return PagedCSR(indptr, indices, last.astype(np.int32), kv_lens.astype(np.int32))
