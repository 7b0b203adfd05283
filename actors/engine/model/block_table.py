"""A host mirror of every running sequence's block table, one row per sampler slot.

The scheduler keeps each sequence's pages in a Python list that only grows (``extend``) or is
replaced by a new list (admission, preemption, fork). The mirror copies only what changed since
the last step (a new list object, or new pages at the end), so a step's ``[B, max_blocks]``
table is one numpy gather instead of a Python loop over every page of every sequence.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np


class BlockTableMirror:
    """``[slots, width]`` int32 page ids; row ``s`` is the table of the sequence in slot ``s``,
    zero beyond its length.

    Args:
        num_slots: rows (the engine's ``max_num_seqs``); grows if a larger slot shows up.
        width: columns (pages of the longest sequence); grows on demand.
    """

    def __init__(self, num_slots: int, width: int):
        self.table = np.zeros((max(1, num_slots), max(1, width)), np.int32)
        self._lists: list[list[int] | None] = [None] * self.table.shape[0]
        self._lens: list[int] = [0] * self.table.shape[0]

    def _grow(self, rows: int, cols: int) -> None:
        rows, cols = max(rows, self.table.shape[0]), max(cols, self.table.shape[1])
        grown = np.zeros((rows, cols), np.int32)
        grown[:self.table.shape[0], :self.table.shape[1]] = self.table
        extra = rows - self.table.shape[0]
        self._lists += [None] * extra
        self._lens += [0] * extra
        self.table = grown

    def update(self, slots: Seq[int], tables: Seq[list[int]]) -> None:
        """Brings the rows of ``slots`` up to date with the given block-table lists."""
        lists, lens = self._lists, self._lens
        for slot, pages in zip(slots, tables):
            if slot >= len(lists) or len(pages) > self.table.shape[1]:
                self._grow(slot + 1, 2 * len(pages))
                lists, lens = self._lists, self._lens
            n = len(pages)
            if lists[slot] is pages:
                old = lens[slot]
                if old == n:
                    continue
                if old < n:
                    self.table[slot, old:n] = pages[old:]
                    lens[slot] = n
                    continue
            row = self.table[slot]
            row[:n] = pages
            row[n:] = 0
            lists[slot] = pages
            lens[slot] = n

    def gather(self, slots: np.ndarray, width: int) -> np.ndarray:
        """``[len(slots), width]`` copy of the rows of ``slots`` (zero past each table)."""
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], width)
        return self.table[slots, :width]
