"""What the scheduler decides for one step (``SchedulerOutput``: the chunks, the rows that
sample, admissions, preemptions, page copies) and its running counts (``SchedulerStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` new tokens of ``seq`` starting at position ``start``."""

    seq: Sequence
    start: int
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: chunk ``i`` is ``num_new[i]`` tokens of ``seqs[i]`` from position
    ``starts[i]`` (parallel lists: no object per chunk on the per-step path; ``chunks`` builds
    :class:`ScheduledChunk` views). ``sample_seqs[r]`` samples from the last row of chunk
    ``sample_chunks[r]`` (forked samples share their parent's row). ``prompt_chunks``: the
    chunks that start inside their prompt (only those can score prompt tokens)."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    prompt_chunks: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_chunks: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)   # got a sampler slot this step
    released_slots: list[int] = field(default_factory=list)  # sampler slots freed by preemption
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src page, dst page)
    # sequences whose slot or block table may have changed since they were last scheduled
    # (admitted, forked, given pages); every other chunk of the step is a decode that kept both
    table_seqs: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def scheduled_ids(self) -> set[int]:
        """``seq_id`` of every sequence in the step: the chunks' and the samples forked from
        them (built when asked, which only preemption does)."""
        return {s.seq_id for s in self.seqs} | {s.seq_id for s in self.sample_seqs}

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return [ScheduledChunk(*c) for c in zip(self.seqs, self.starts, self.num_new)]

    def add_chunk(self, seq: Sequence, start: int, num_new: int) -> int:
        """Appends a chunk; returns its index."""
        self.seqs.append(seq)
        self.starts.append(start)
        self.num_new.append(num_new)
        self.num_tokens += num_new
        return len(self.seqs) - 1


@dataclass(slots=True)
class SchedulerStats:
    num_prompt_tokens_computed: int = 0   # prompt positions run through the model
    num_cached_prompt_tokens: int = 0     # prompt positions served by the prefix cache
    num_preemptions: int = 0
    num_steps: int = 0
