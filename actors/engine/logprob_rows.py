"""The lists a step's logprob rows append to, kept while those rows stay the same.

Each sequence that asked for logprobs keeps per-step lists (``logprobs``, ``sampled_ranks``,
and with top-k ``top_blocks``/``top_rows``). In steady decoding a step's logprob rows are the
same sequences at the same rows as the step before, so ``LogprobRows`` looks those list
objects up once and, while the rows stay the same, a step appends to them with numpy
gathers and C-level list appends; the sequences are read again only when the rows change.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

import numpy as np

from actors.engine.sequence import Sequence


def _append_each(lists: list[list], values) -> None:
    """``lists[i].append(values[i])`` for every ``i``, iterated in C."""
    deque(map(list.append, lists, values), maxlen=0)


class LogprobRows:
    """The logprob lists of the last step's logprob rows."""

    __slots__ = ("seqs", "rows", "index", "values", "ranks", "top_index", "top_blocks",
                 "top_rows")

    def __init__(self) -> None:
        self.seqs: list[Sequence] | None = None
        self.rows: list[int] = []

    def _look_up(self, seqs: list[Sequence], rows: list[int]) -> None:
        self.seqs, self.rows = seqs, rows
        self.index = np.asarray(rows, np.int64)
        self.values = [seq.logprobs for seq in seqs]
        self.ranks = [seq.sampled_ranks for seq in seqs]
        tops = [(seq, row) for seq, row in zip(seqs, rows) if seq.top_rows is not None]
        self.top_index = np.asarray([row for _, row in tops], np.int64)
        self.top_blocks = [seq.top_blocks for seq, _ in tops]
        self.top_rows = [seq.top_rows for seq, _ in tops]

    def record(self, seqs: list[Sequence], rows: list[int], values: np.ndarray,
               ranks: np.ndarray, top_ids: np.ndarray | None,
               top_values: np.ndarray | None) -> None:
        """Appends row ``rows[i]`` of the step's ``values`` ``[S]``, ``ranks`` ``[S]`` and
        top-k ``[S, k]`` to the lists of ``seqs[i]``; the top-k rows go into one block the
        step's top-k sequences share (copied: the step's host buffer is not kept alive)."""
        if self.seqs is None or rows != self.rows or seqs != self.seqs:
            self._look_up(seqs, rows)
        _append_each(self.values, values[self.index].tolist())
        _append_each(self.ranks, ranks[self.index].tolist())
        if self.top_rows:
            block = (top_ids[self.top_index], top_values[self.top_index])
            _append_each(self.top_blocks, repeat(block))
            _append_each(self.top_rows, range(len(self.top_rows)))
