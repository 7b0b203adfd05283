"""Sampled-token logprobs kept per step, and handed to each sequence when it finishes.

A step's logprob rows (the sequences that asked for logprobs) are usually the previous step's:
the same sequences at the same rows. ``LogprobRows`` stores such a stretch of steps as one
*run*: per step, the rows' values, ranks and top-k block as arrays; a sequence only notes its
column in the run when the run starts. A step of an unchanged run costs a few numpy gathers
and no per-row Python; a new run (the rows changed) notes its column once per row.
``flush`` moves a sequence's runs into its ``logprobs`` / ``sampled_ranks`` (and
``top_blocks`` / ``top_rows``) lists; the output processor calls it before it reads them
(finish, abort).
"""

from __future__ import annotations

import numpy as np

from actors.engine.sequence import Sequence


class _Run:
    """Consecutive steps with the same logprob rows: per step ``[L]`` values and ranks, and
    the top-k block the run's top-k rows share (``[T, k]`` ids and values)."""

    __slots__ = ("seqs", "rows", "index", "top_index", "values", "ranks", "tops", "_stacked")

    def __init__(self, seqs: list[Sequence], rows: list[int]):
        self.seqs, self.rows = seqs, rows
        self.index = np.asarray(rows, np.int64)
        self.top_index = np.asarray(
            [row for seq, row in zip(seqs, rows) if seq.top_rows is not None], np.int64)
        self.values: list[np.ndarray] = []
        self.ranks: list[np.ndarray] = []
        self.tops: list[tuple[np.ndarray, np.ndarray]] = []
        self._stacked: tuple[int, np.ndarray, np.ndarray] | None = None

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """``[steps, L]`` values and ranks of the steps so far (stacked once per length)."""
        n = len(self.values)
        if self._stacked is None or self._stacked[0] != n:
            self._stacked = (n, np.stack(self.values), np.stack(self.ranks))
        return self._stacked[1], self._stacked[2]


class LogprobRows:
    """The current run of logprob rows; each sequence's runs not yet flushed sit in its
    ``logprob_runs`` as ``(run, column, top-k column or -1)``."""

    def __init__(self) -> None:
        self.run: _Run | None = None

    def record(self, seqs: list[Sequence], rows: list[int], values: np.ndarray,
               ranks: np.ndarray, top_ids: np.ndarray | None,
               top_values: np.ndarray | None) -> None:
        """Records row ``rows[i]`` of the step's ``values`` ``[S]``, ``ranks`` ``[S]`` and
        top-k ``[S, k]`` for ``seqs[i]`` (the top-k rows copied into one block)."""
        run = self.run
        if run is None or rows != run.rows or seqs != run.seqs:
            run = self.run = _Run(seqs, rows)
            top_col = 0
            for col, seq in enumerate(seqs):
                if seq.top_rows is not None:
                    seq.logprob_runs.append((run, col, top_col))
                    top_col += 1
                else:
                    seq.logprob_runs.append((run, col, -1))
        run.values.append(values[run.index])
        run.ranks.append(ranks[run.index])
        if len(run.top_index):
            run.tops.append((top_ids[run.top_index], top_values[run.top_index]))

    def flush(self, seq: Sequence) -> None:
        """Appends the steps of ``seq``'s runs to its lists (it is in every step of each of
        its runs, the last one up to now)."""
        runs = seq.logprob_runs
        if not runs:
            return
        for run, col, top_col in runs:
            values, ranks = run.stacked()
            seq.logprobs.extend(values[:, col].tolist())
            seq.sampled_ranks.extend(ranks[:, col].tolist())
            if top_col >= 0:
                seq.top_blocks.extend(run.tops)
                seq.top_rows.extend([top_col] * len(run.tops))
            if run is self.run:  # it goes on without this sequence: the next step starts anew
                self.run = None
        runs.clear()
