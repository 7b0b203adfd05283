"""The sampling rows of the last prepared step, for the next step that decodes exactly them.

In steady decoding a step runs the same sequences, in the same order, as the step before it
(still in flight), each on the one token that step sampled for it. Then that step's sample
rows say everything the new step's rows need: their slots, their positions (the sequence
lengths that step computed), and every input id is that step's sample of the same row, still
on the device. ``DecodeRows`` keeps those arrays from one ``prepare`` to the next, so such a
step reads nothing per row; any other step (an admission, a fork, a finish, a preemption, a
prefill chunk, or a previous step already read back) builds its arrays from the sequences.
"""

from __future__ import annotations

import numpy as np

from actors.engine.sequence import Sequence


class DecodeRows:
    """The last prepared step's sample rows: ``seqs`` (a list, in row order), their sampler
    ``slots`` ``[S]`` and the sequence lengths the step computed for them (``lens`` ``[S]``,
    the next decode position of each)."""

    __slots__ = ("seqs", "slots", "lens")

    def __init__(self) -> None:
        self.seqs: list[Sequence] | None = None
        self.slots = np.zeros(0, np.int64)
        self.lens = np.zeros(0, np.int64)

    def record(self, seqs: list[Sequence], slots: np.ndarray, lens: np.ndarray) -> None:
        """Keeps a prepared step's sample rows (``slots`` and ``lens`` are not written later)."""
        self.seqs, self.slots, self.lens = seqs, slots, lens

    def continues(self, seqs: list[Sequence], num_tokens: int,
                  inflight: list[Sequence] | None) -> bool:
        """Whether a step of chunks ``seqs`` (``num_tokens`` in all) decodes exactly the
        recorded rows, one token each, while the recorded step is the one in flight
        (``inflight``: its sample rows, the very list recorded, or None when no step is in
        flight). Then row ``i`` of the step is the recorded row ``i``: slot ``slots[i]``,
        position ``lens[i]``, and its input id is row ``i`` of the in-flight step's samples."""
        recorded = self.seqs
        return (inflight is not None and inflight is recorded and num_tokens == len(seqs)
                and seqs == recorded)
