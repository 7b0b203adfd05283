"""Continuous-batching scheduler: which tokens of which sequences run in the next step.

Pure Python over ``Sequence`` objects and a ``BlockManager``; no model, no torch. Each step:
1. running sequences, decodes first, then unfinished prefills (chunked to the token budget);
   when pages run out the newest running sequence is preempted (its pages freed, recomputed
   later), possibly the one being scheduled;
2. waiting sequences in arrival order (preempted ones first), with prefix-cache hits, while
   the budget, the sampler slots and the pages allow (none when step 1 preempted); a
   sequence whose structured-output constraint is still compiling is passed over.
A request asking for n samples holds n slots from admission; its prompt is computed once and
the sequence forks into n when its last prompt chunk is scheduled (full pages shared, the
partial last page copied).

``batch_invariant`` changes the policy: a step is either one sequence's prefill chunk (a
running prefill first, else one newly admitted sequence) or only decodes, so a sequence's
attention kernels see the same shapes whatever its batch-mates.
"""

from __future__ import annotations

import math
from collections import deque

from actors.engine.block_manager import BlockManager, hash_block
from actors.engine.scheduler_output import SchedulerOutput, SchedulerStats
from actors.engine.sequence import PENDING, SeqStatus, Sequence


class Scheduler:
    """Decides each step's batch under ``max_num_batched_tokens`` and ``max_num_seqs``."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        batch_invariant: bool = False,
    ):
        self.bm = block_manager
        self.batch_invariant = batch_invariant
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admission_room(self) -> tuple[int, int]:
        """What the next step could admit beyond the waiting queue: the sampler slots no
        waiting sequence claims and the token budget its prompts leave (either at or below
        0: the waiting queue can fill the next step's admissions). A sequence whose
        constraint still compiles does not count (admission passes it over). With prefix
        caching a prompt may be mostly cached, so only the slots bound it (the tokens are
        infinite)."""
        slots = len(self.free_slots)
        tokens = math.inf if self.bm.enable_prefix_caching else self.max_num_batched_tokens
        for seq in self.waiting:
            if seq.request.grammar is not None and seq.request.is_compiling:
                continue  # passed over until its constraint compiles (_admit)
            slots -= seq.fanout
            tokens -= len(seq.token_ids) - seq.num_computed_tokens
            if slots <= 0 or tokens <= 0:
                break
        return slots, tokens

    def is_generation_done(self, seq: Sequence) -> bool:
        """Whether the sequence already holds its last token (value possibly pending)."""
        return seq.num_tokens >= min(seq.max_num_tokens, self.max_model_len)

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefills: list[Sequence] = []
        if self.batch_invariant:
            decodes: list[Sequence] = []
            for s in self.running:
                left = len(s.token_ids) - s.num_computed_tokens
                if left == 1:
                    decodes.append(s)
                elif left > 1:
                    prefills.append(s)
            return self._schedule_invariant(decodes, prefills, out)
        # decodes in running order, then the unfinished prefills: one pass over the running
        # sequences schedules the decodes and sets the prefills aside (a copy of the list:
        # preemption removes from it)
        budget = self._schedule_running(list(self.running), budget, out, prefills)
        if prefills and budget:
            budget = self._schedule_running(prefills, budget, out)
        if not out.preempted:
            self._admit(budget, out)
        self.stats.num_steps += 1
        return out

    def _schedule_invariant(self, decodes: list[Sequence], prefills: list[Sequence],
                            out: SchedulerOutput) -> SchedulerOutput:
        """One prefill chunk alone (a running prefill, else one admission), else decodes."""
        budget = self.max_num_batched_tokens
        if prefills:
            self._schedule_running(prefills[:1], budget, out)
        elif self.waiting:
            self._admit(budget, out, limit=1)
        if not out.seqs and not out.preempted:
            self._schedule_running(decodes, budget, out)
        self.stats.num_steps += 1
        return out

    def _schedule_running(self, seqs, budget: int, out: SchedulerOutput,
                          prefills: list[Sequence] | None = None) -> int:
        """Schedules running sequences in order while the budget lasts; returns what is
        left of it. With ``prefills``, schedules only the decodes (one token left) and
        appends the sequences with more than one token left to it."""
        bm, bs, max_len = self.bm, self.block_size, self.max_model_len
        running = SeqStatus.RUNNING
        prefix_caching = bm.enable_prefix_caching
        seqs_out, starts, nums = out.seqs, out.starts, out.num_new
        sample_seqs, sample_chunks = out.sample_seqs, out.sample_chunks
        split = prefills is not None
        added = 0  # tokens of the inlined decode chunks (added to out.num_tokens at the end)
        for seq in seqs:  # inlined per-sequence checks:
            if budget == 0:                              # this loop runs for every running
                break                                    # sequence at every step
            if seq.status is not running:
                continue
            num_tokens = len(seq.token_ids)
            start = seq.num_computed_tokens
            if num_tokens - start == 1 and num_tokens <= seq.steady_until:
                # a decode within its steady bound (set when it was last scheduled through
                # _schedule_chunk): none of the checks below can change its chunk
                seq.num_computed_tokens = num_tokens
                sample_chunks.append(len(seqs_out))
                seqs_out.append(seq)
                sample_seqs.append(seq)
                starts.append(start)
                nums.append(1)
                added += 1
                budget -= 1
                continue
            if split and num_tokens - start != 1:
                if num_tokens - start > 1:
                    prefills.append(seq)
                continue
            if num_tokens >= max_len or num_tokens >= seq.max_num_tokens:
                continue  # is_generation_done
            num_new = min(num_tokens - start, budget)
            after = start + num_new
            need = -(-after // bs) - len(seq.block_table)
            if need <= 0 and start >= seq.num_prompt and seq.fanout == 1 and not (
                    prefix_caching and self._blocks_to_register(seq, after)):
                # the common decode chunk: no pages, no prompt rows, no fork, no new full
                # block (what _schedule_chunk does for it, inlined; its slot and block table
                # are as when it was last scheduled, so it is not in out.table_seqs)
                seq.num_computed_tokens = after
                seqs_out.append(seq)
                starts.append(start)
                nums.append(num_new)
                added += num_new
                budget -= num_new
                if after == num_tokens:
                    sample_chunks.append(len(seqs_out) - 1)
                    sample_seqs.append(seq)
                seq.steady_until = self._steady_bound(seq)
                continue
            if seq.fanout > 1:
                need += self._fork_pages(seq, after)
            if need > bm.num_free_blocks:
                scheduled = out.scheduled_ids  # preempting unscheduled sequences keeps it
                while need > bm.num_free_blocks:
                    victim = self._newest_unscheduled(scheduled)
                    if victim is None:  # only sequences of this step hold pages: wait a step
                        break
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not running or need > bm.num_free_blocks:
                    continue
            self._schedule_chunk(seq, num_new, need, out)
            budget -= num_new
        out.num_tokens += added
        return budget

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled:
                return seq
        return None

    def _admit(self, budget: int, out: SchedulerOutput, limit: int | None = None) -> None:
        bs = self.block_size
        while self.waiting and budget > 0 and (limit is None or len(out.admitted) < limit):
            seq = self.waiting[0]
            if seq.request.grammar is not None and seq.request.is_compiling:
                seq = self._first_ready()  # it waits without holding the queue
                if seq is None:
                    break
            if seq.num_pending or len(self.free_slots) < seq.fanout:
                break
            self._update_hashes(seq)
            hits = self._prefix_hits(seq)
            num_cached = len(hits) * bs
            num_new = min(seq.num_tokens - num_cached, budget)
            total = math.ceil((num_cached + num_new) / bs)
            need = total - len(hits) + self._fork_pages(seq, num_cached + num_new)
            if need + self.bm.num_free_among(hits) > self.bm.num_free_blocks:
                break
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            self.bm.share(hits)
            self.bm.num_hit_blocks += len(hits)
            seq.block_table = list(hits)
            seq.num_computed_tokens = num_cached
            seq.num_registered_blocks = len(hits)
            self.stats.num_cached_prompt_tokens += min(num_cached, seq.num_prompt_tokens)
            seq.slot = self.free_slots.pop()
            seq.reserved_slots = [self.free_slots.pop() for _ in range(seq.fanout - 1)]
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            self._schedule_chunk(seq, num_new, need, out)
            budget -= num_new

    # ------------------------------------------------------------------ helpers
    def _first_ready(self) -> Sequence | None:
        """The first waiting sequence whose request is not compiling its constraint."""
        for seq in self.waiting:
            if not seq.request.is_compiling:
                return seq
        return None

    def _fork_pages(self, seq: Sequence, computed_after: int) -> int:
        """Extra pages the fork needs when this chunk completes a fanning-out prompt."""
        if seq.fanout > 1 and computed_after == seq.num_tokens and seq.num_tokens % self.block_size:
            return seq.fanout - 1
        return 0

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        after = seq.num_computed_tokens + num_new
        return (math.ceil(after / self.block_size) - len(seq.block_table)
                + self._fork_pages(seq, after))

    def _schedule_chunk(self, seq: Sequence, num_new: int, need: int, out: SchedulerOutput) -> None:
        start = seq.num_computed_tokens
        after = start + num_new
        fork_pages = self._fork_pages(seq, after) if seq.fanout > 1 else 0
        if need > fork_pages:
            seq.block_table.extend(self.bm.allocate(need - fork_pages))
        out.table_seqs.append(seq)
        seq.num_computed_tokens = after
        chunk_idx = out.add_chunk(seq, start, num_new)
        num_prompt = seq.num_prompt
        if start < num_prompt:
            out.prompt_chunks.append(chunk_idx)
            self.stats.num_prompt_tokens_computed += min(after, num_prompt) - start
        if self.bm.enable_prefix_caching and self._blocks_to_register(seq, after):
            self._register_blocks(seq)
        if after == len(seq.token_ids):  # the chunk reaches the end: its last row samples
            out.sample_seqs.append(seq)
            out.sample_chunks.append(chunk_idx)
            if seq.fanout > 1:
                self._fork(seq, chunk_idx, out)
        seq.steady_until = self._steady_bound(seq)

    def _steady_bound(self, seq: Sequence) -> int:
        """The token count up to which a one-token decode chunk of ``seq`` is the common
        case, as its pages, prompt, fan-out and registered blocks stand now (they change only
        through ``_schedule_chunk``, which sets the bound again, or preemption, which clears
        it): the chunk needs no page, is not a prompt row, forks nothing, registers no block
        and does not end the generation. 0 when its next chunk is not such a decode."""
        if seq.fanout > 1 or seq.num_computed_tokens < seq.num_prompt:
            return 0
        bound = min(len(seq.block_table) * self.block_size, self.max_model_len - 1,
                    seq.max_num_tokens - 1)
        if self.bm.enable_prefix_caching:  # before the next full block of known or computed
            registered = min(len(seq.block_hashes), seq.num_registered_blocks)
            bound = min(bound, (registered + 1) * self.block_size - 1)
        return bound

    def _blocks_to_register(self, seq: Sequence, computed_after: int) -> bool:
        """Whether a block of ``seq`` became full or computed (false on most decode steps)."""
        bs = self.block_size
        known = len(seq.token_ids) - seq.num_pending
        return known // bs > len(seq.block_hashes) or \
            computed_after // bs > seq.num_registered_blocks

    def _fork(self, parent: Sequence, chunk_idx: int, out: SchedulerOutput) -> None:
        full = parent.num_tokens // self.block_size
        for j in range(1, parent.fanout):
            child = parent.fork(parent.sample_index + j)
            shared = parent.block_table[:full]
            self.bm.share(shared)
            child.block_table = list(shared)
            if len(parent.block_table) > full:
                page = self.bm.allocate(1)[0]
                out.copies.append((parent.block_table[full], page))
                child.block_table.append(page)
            child.slot = parent.reserved_slots.pop()
            out.table_seqs.append(child)
            self.running.append(child)
            out.admitted.append(child)
            out.sample_seqs.append(child)
            out.sample_chunks.append(chunk_idx)
        parent.fanout = 1

    def _update_hashes(self, seq: Sequence) -> None:
        if not self.bm.enable_prefix_caching:
            return
        bs = self.block_size
        known = seq.num_tokens - seq.num_pending
        hashes = seq.block_hashes
        for i in range(len(hashes), known // bs):
            block = seq.token_ids[i * bs:(i + 1) * bs]
            assert PENDING not in block
            hashes.append(hash_block(hashes[-1] if hashes else None, block))

    def _register_blocks(self, seq: Sequence) -> None:
        if not self.bm.enable_prefix_caching:
            return
        self._update_hashes(seq)
        upto = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, upto):
            self.bm.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, upto)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        if not self.bm.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        request = seq.request
        if not request.prompt_scoring_done:  # never skip prompt rows that still need scoring
            limit = min(limit, request.num_prompt_rows_scored // self.block_size)
        return self.bm.lookup(seq.block_hashes[:limit])

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.steady_until = 0
        self._release_slots(seq, out.released_slots)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.stats.num_preemptions += 1

    def _release_slots(self, seq: Sequence, released: list[int]) -> None:
        if seq.slot >= 0:
            released.append(seq.slot)
            self.free_slots.append(seq.slot)
        self.free_slots.extend(seq.reserved_slots)
        seq.slot = -1
        seq.reserved_slots = []

    # ------------------------------------------------------------------ finishing
    def finish(self, seq: Sequence) -> list[int]:
        """Removes a finished sequence; returns the sampler slot it released (if any)."""
        return self.finish_all([seq])

    def finish_all(self, seqs: list[Sequence]) -> list[int]:
        """Removes finished sequences (one pass over the running ones for them all); returns
        the sampler slots they released."""
        running = {id(seq) for seq in seqs if seq.status is SeqStatus.RUNNING}
        if running:
            self.running[:] = [seq for seq in self.running if id(seq) not in running]
        released: list[int] = []
        for seq in seqs:
            if seq.status is SeqStatus.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
            self.bm.free(seq.block_table)
            seq.block_table = []
            self._release_slots(seq, released)
            seq.status = SeqStatus.FINISHED
        return released
