"""Structured outputs in the engine: constraints compiled off the stepping thread, one
grammar matcher per sequence, and each step's packed token masks.

``StructuredOutputs.submit`` compiles a request's constraint once per distinct constraint
(:mod:`actors.engine.structured_compile`); the scheduler admits the request only once its
future is done, and a constraint that does not compile becomes the request's error before any
device work. Each sequence (each of n samples) gets its own matcher
(:class:`~actors.engine.structured_sequence.SequenceGrammar`), which accepts the sequence's
output tokens in order and only once (``num_accepted``), so preemption and recompute never
lose or double a token. After a step's sampler launch, ``advance`` starts the ahead fill on a
thread of its own: once the step's sampled ids are on the host it advances the matchers (one
parallel llguidance call) and fills the masks that follow (one parallel call) into a pinned host
buffer, while the stepping thread goes on (it launches the next forward, then processes the
step's outputs once the ids are accepted, :meth:`wait_accepted`); the next ``step_mask`` takes
the masks, fills the rows the ahead fill did not cover, and queues the upload to the device:
on CUDA, when every row comes from the ahead fill, before the fill ends (the copy waits on the
device for it, :class:`~actors.engine.structured_masks.MaskBuffers`), so the sampler is
launched while the masks fill. Library choice and measurements: docs/structured_outputs.md.
"""

from __future__ import annotations

import threading
from operator import attrgetter
from concurrent.futures import Future, ThreadPoolExecutor, wait, FIRST_COMPLETED
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import numpy as np
import torch

from actors.engine.cpu_threads import usable_cpus
from actors.engine.sequence import PENDING, Sequence
from actors.engine.structured_compile import ConstraintCompiler
from actors.engine.structured_masks import MaskBuffers
from actors.engine.structured_plan import AheadPlan, continues, mask_slots, template_order
from actors.engine.structured_sequence import CompiledConstraint, SequenceGrammar
from sampler.grammar_mask import StepBitmask
from sampler.structured_params import StructuredOutputsParams

_GRAMMAR, _MATCHER = attrgetter("grammar"), attrgetter("matcher")


class StructuredOutputs:
    """Compiled constraints (:class:`ConstraintCompiler`), per-sequence matchers and step
    masks of one engine.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the logits' width (the masks cover it; ids past the tokenizer's are
            never allowed).
        eos_token_ids: the ids that end a text where the grammar may end.
        device: where the sampler runs.
        max_num_seqs: the most rows a step samples.
        num_threads: compile threads.
        fill_threads: threads of the parallel accept and mask fill (default: the cores this
            process may run on less two, 2 to 16).
        max_templates: the most matcher templates of a constraint shared by many sequences
            (default: ``fill_threads``).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Seq[int],
                 device: torch.device, max_num_seqs: int, num_threads: int = 2,
                 fill_threads: int | None = None, max_templates: int | None = None) -> None:
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.compiler = ConstraintCompiler(tokenizer, vocab_size=vocab_size,
                                           eos_token_ids=eos_token_ids, num_threads=num_threads)
        self.fill_threads = fill_threads or max(2, min(16, usable_cpus() - 2))
        self.max_templates = max_templates or self.fill_threads
        self.words = (vocab_size + 31) // 32
        self.num_active = 0  # sequences holding a matcher (host predicate of step_mask)
        self._executor = None
        self.buffers = MaskBuffers(self.device, max_num_seqs, self.words)
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._running: _Running | None = None  # the ahead fill running (see advance)
        # an ahead fill whose masks a step took while they filled (the upload waits on the
        # device): joined before that step's outputs are read (wait_accepted) or at a settle
        self._behind: _Running | None = None
        self._done: AheadPlan | None = None  # its plan (masks), for the next step_mask
        self._last: AheadPlan | None = None  # the latest plan (the next may repeat it)
        # (step rows, number of rows, their StepBitmask rows and row map): _in_step_order
        self._index: tuple | None = None
        self._fills = 0
        self.rows_ahead = 0  # masks taken from an ahead fill, and filled in step_mask
        self.rows_here = 0

    # ------------------------------------------------------------------ compiling
    def submit(self, so: StructuredOutputsParams) -> Future:
        """The future of ``so``'s :class:`CompiledConstraint` (:meth:`ConstraintCompiler.
        submit`; any thread)."""
        return self.compiler.submit(so)

    @staticmethod
    def wait_any(futures: list[Future], timeout: float) -> None:
        """Blocks until one of ``futures`` is done or ``timeout`` seconds passed."""
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ sequences
    def start(self, seq: Sequence) -> None:
        """Gives ``seq`` its matcher (first admission, or a fork), or brings the one it
        kept through a preemption up to its known tokens."""
        if seq.grammar is None:
            compiled: CompiledConstraint = seq.request.grammar.result()
            matcher, group = compiled.next_copy(self.compiler.ll_tokenizer(), self.max_templates)
            seq.grammar = SequenceGrammar(matcher, group)
            self.num_active += 1
        else:
            self.settle()  # its matcher may be in the ahead fill
        seq.grammar.catch_up(seq)

    def release(self, seq: Sequence) -> None:
        if seq.grammar is not None:
            seq.request.grammar.result().release(seq.grammar.group)
            seq.grammar = None
            self.num_active -= 1

    # ------------------------------------------------------------------ masks
    def advance(self, seqs: list[Sequence], pending_pos: list[int], output: Any) -> None:
        """Starts the ahead fill of a step just launched: on a thread of its own, once the
        step's sampled ids are on the host (``output``, its ``AsyncOutput``), the matchers of
        its constrained rows accept them (row ``r`` sampled the token at ``pending_pos[r]``
        of ``seqs[r]``) and the masks that follow are filled and uploaded, while the stepping
        thread processes outputs, schedules and launches the next forward. Until
        :meth:`settle`, the stepping thread calls no matcher of these rows (the output
        processor reads :meth:`SequenceGrammar.error_by` / ``ended_by``, which the ahead fill
        cannot change for a token it has not accepted).

        What needs no sampled id is done here, off the fill's path: the rows in template
        order, each row's place in the masks (``mask_turn``, ``mask_row``, ``mask_at``; the
        ahead fill takes it back from a row that refuses its token) and the lists of its
        llguidance calls; when the step samples the last fill's rows again, one token on
        (:func:`continues`), that fill's order and lists are taken as they are. The ahead
        fill notes where the grammars ended right after its accept (:meth:`wait_accepted`
        returns then); the masks are uploaded by the step that takes them (:meth:`step_mask`),
        which may queue the upload before they are written."""
        self.settle(behind=False)  # a fill behind may still be writing: the pool runs in turn
        self.buffers.mark_read()  # the sampler that reads the last step_mask's masks is queued
        pos = np.asarray(pending_pos, dtype=np.int64)
        last = self._last
        if last is not None and continues(last, seqs) and np.array_equal(pos, last.pos + 1):
            # the last fill's rows again, each one token on: its order and lists again
            picked, rows, matchers, targets = last.grammars, last.rows, last.matchers, \
                last.targets
            step_rows, slots = last.step_rows, None
        else:
            grammars = list(map(_GRAMMAR, seqs))
            # the rows whose matcher is at the token they sampled
            chosen = [r for r, grammar, seq, p in zip(range(len(seqs)), grammars, seqs,
                                                      pending_pos)
                      if grammar is not None and grammar.error is None
                      and grammar.num_accepted == p - seq.num_prompt]
            if not chosen:
                self._last = None
                return
            picked = [grammars[r] for r in chosen]
            order = template_order(picked)
            if order is not None:
                picked = [picked[j] for j in order]
                chosen = [chosen[j] for j in order]
            rows = np.asarray(chosen, dtype=np.int64)
            matchers = list(map(_MATCHER, picked))
            step_rows, slots = mask_slots(rows)
            targets = list(zip(matchers, slots))
            if len(picked) + grammars.count(None) < len(seqs):
                step_rows = None  # not every constrained row: the next step_mask sorts them
        self._fills += 1
        turn = self._fills
        if slots is None:  # the same rows as the last fill
            for grammar in picked:
                grammar.mask_turn, grammar.mask_at = turn, grammar.num_accepted + 1
        else:
            for grammar, slot in zip(picked, slots):
                grammar.mask_turn, grammar.mask_row, grammar.mask_at = \
                    turn, slot, grammar.num_accepted + 1
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-ahead")
        plan = self._last = AheadPlan(picked, rows, turn, self.buffers.take(), matchers,
                                       targets, threading.Event(), seqs, pos, step_rows)
        self._running = _Running(self._ahead_pool.submit(self._advance, plan, output), output,
                                 plan)

    def settle(self, output: Any = None, behind: bool = True) -> None:
        """Waits for the ahead fill, if one runs (its masks wait for the next step); with
        ``output``, only for the fill of that step (whose outputs are to be processed: a
        step that sampled no row did not wait for it). ``behind``: also for a fill whose
        masks a step took while they filled (raising its error)."""
        if behind:
            self._join_behind()
        running = self._running
        if running is None or (output is not None and output is not running.output):
            return
        self._running = None
        running.future.result()  # its error, if it failed
        self._done = running.plan

    def filling_after(self, output: Any) -> bool:
        """Whether an ahead fill runs after the step of ``output`` (the next step's masks
        come from it)."""
        return self._running is not None and output is self._running.output

    def wait_accepted(self, output: Any) -> None:
        """Waits until the ahead fill after the step of ``output`` (if one runs) has
        accepted that step's sampled ids and noted where the grammars ended; its masks may
        still be filling. From then until :meth:`settle`, the stepping thread may read what
        the output processor reads (:meth:`SequenceGrammar.error_by`, ``ended_by``), and
        call the matchers of rows outside the fill, but no matcher of its rows."""
        # the fill that wrote the masks of the step of ``output`` (its sampler waited for
        # it on the device): a fill that failed fails the step before its outputs are read
        self._join_behind()
        running = self._running  # (not filling_after: the engine's order may differ)
        if running is not None and output is running.output:
            # set even when the fill fails (its error comes from settle)
            running.plan.accepted.wait()

    def _join_behind(self) -> None:
        behind = self._behind
        if behind is not None:
            self._behind = None
            behind.future.result()  # its error, if it failed

    def _advance(self, plan: "AheadPlan", output: Any) -> None:
        try:
            try:
                tokens = np.asarray(output.get().token_ids)[plan.rows].tolist()
                grammars, targets = plan.grammars, plan.targets
                plan.ok = self._accept_par(grammars, tokens, matchers=plan.matchers)
                if not plan.ok:
                    for grammar in grammars:  # some row refused its token
                        if grammar.error is not None:
                            grammar.mask_turn = -1  # it takes no mask
                    grammars = [grammar for grammar in grammars if grammar.error is None]
                    targets = [(grammar.matcher, grammar.mask_row) for grammar in grammars]
            finally:
                plan.accepted.set()  # the step's outputs may be processed during the fill
            if grammars:
                self._fill(targets, plan.masks.host)
        finally:
            # an upload queued to wait for these masks starts (also after an error: the
            # device never waits for a fill that ended; the error fails the step)
            self.buffers.filled(plan.turn)

    def step_mask(self, seqs: list[Sequence], prev_tokens) -> StepBitmask | None:
        """The masks of a step's constrained rows (row ``r`` samples ``seqs[r]``), on the
        device; None when no row is constrained. A row the ahead fill left at the state
        this step samples from takes its mask; the others (new rows, rows back from a
        preemption, a step without an ahead fill) accept their unaccepted tokens and are
        filled here. A step that samples the fill's rows again (:func:`continues`) takes
        every mask in the fill's order, without reading a row.

        Args:
            seqs: the step's sampling sequences.
            prev_tokens: a callable giving the previous step's sampled ids as a host array
                (called only when a row filled here still waits for its last token).
        """
        running = self._running
        if running is not None:
            # once the ahead fill has accepted (the engine waited for that to process the
            # step's outputs) it writes no row's fields: the rows are sorted here while its
            # masks may still be filling
            running.plan.accepted.wait()
            done = running.plan
        else:
            done = self._done
        # the fill's step again, each row one token on: every row takes its mask, none is read
        repeat = done is not None and continues(done, seqs)
        rows = [] if repeat else [r for r, seq in enumerate(seqs) if seq.grammar is not None]
        source = here = None
        if rows and done is not None:
            turn, base = done.turn, len(done.grammars)
            source, here = [], []
            for r in rows:
                seq = seqs[r]
                grammar = seq.grammar
                if (grammar.mask_turn == turn and grammar.mask_at == grammar.num_accepted
                        == len(seq.token_ids) - seq.num_prompt):
                    source.append(grammar.mask_row)
                else:
                    source.append(base + len(here))
                    here.append(seq)
        # masks that fill ahead and need no row filled here: their upload is queued now and
        # waits on the device for the fill's end (MaskBuffers.hand_over; on the CPU the copy
        # waits); else the host waits
        wait_fill = None
        if running is not None and not here and self.buffers.device_wait:
            self._join_behind()  # (joined already when this step's outputs were read)
            self._running, self._behind = None, running
            wait_fill = done.turn
        else:
            self.settle()
        self._done = None
        self.buffers.mark_read()
        if repeat:
            self.rows_ahead += len(done.grammars)
            bits = self.buffers.hand_over(done.masks, len(done.grammars), wait_fill)
            return self._in_step_order(bits, done.step_rows, len(seqs))
        if not rows:
            return None
        if done is None:  # every row is filled here, in order
            base, here = 0, [seqs[r] for r in rows]
            masks = self.buffers.take()
        else:
            masks = done.masks
        self.rows_ahead += len(rows) - len(here)
        self.rows_here += len(here)
        total = base + len(here)
        if here:
            self._fill_here(here, prev_tokens, masks.host, base)
        bits = self.buffers.hand_over(masks, total, wait_fill)  # ahead and here: one copy
        if source is not None and total == len(rows) and source == list(range(total)):
            source = None  # in order: nothing to gather
        return StepBitmask.build(bits, np.asarray(rows, dtype=np.int64), len(seqs),
                                 self.device, source=source)

    def _in_step_order(self, bits: torch.Tensor, step_rows: np.ndarray,
                       num_rows: int) -> StepBitmask:
        """A fill's masks, which lie in the order of its step rows ``step_rows``; the rows'
        device index of the last such step when its rows are these very ones (steps that
        sample the fill's rows again, one token on, upload none)."""
        index = self._index
        if index is not None and index[0] is step_rows and index[1] == num_rows:
            return StepBitmask(bits, index[2], index[3])
        mask = StepBitmask.build(bits, step_rows, num_rows, self.device)
        self._index = (step_rows, num_rows, mask.rows, mask.row_map)
        return mask

    def _fill_here(self, seqs: list[Sequence], prev_tokens, buf: torch.Tensor,
                   base: int) -> None:
        """Accepts the known tokens of ``seqs`` and fills their masks into ``buf`` rows
        ``base``, ``base + 1``, ... in order (the calls take the rows in template order). A
        row whose matcher has accepted nothing (a new row's first token) takes its
        constraint's first mask, filled once (:meth:`CompiledConstraint.first_mask`)."""
        host_prev = None
        matchers, grammars, singles = [], [], []
        fresh: dict[int, tuple[Any, list[int]]] = {}  # constraint -> (it, its new rows)
        order = template_order([seq.grammar for seq in seqs])
        for j in range(len(seqs)) if order is None else order:
            seq = seqs[j]
            grammar = seq.grammar
            if grammar.num_accepted == 0 and len(seq.token_ids) == seq.num_prompt:
                compiled = seq.request.grammar.result()
                fresh.setdefault(id(compiled), (compiled, []))[1].append(base + j)
                continue
            matchers.append((grammar.matcher, base + j))
            pending = PENDING
            if seq.num_pending:
                if host_prev is None:
                    host_prev = _host_list(prev_tokens())
                pending = host_prev[seq.pending_row]
                tokens = seq.token_ids
                if (grammar.error is None and pending != PENDING and tokens[-1] == PENDING
                        and seq.num_prompt + grammar.num_accepted == len(tokens) - 1):
                    # new_tokens' decode-step case, inline (no call and no list a row)
                    grammars.append(grammar)  # a decode step: accepted in parallel
                    singles.append(pending)
                    continue
            todo = grammar.new_tokens(seq, pending)
            if len(todo) == 1 and grammar.error is None:
                grammars.append(grammar)
                singles.append(todo[0])
            else:
                grammar.accept(todo)
        if grammars:
            self._accept_par(grammars, singles)
        if matchers:
            self._fill(matchers, buf)
        for compiled, rows in fresh.values():
            buf[rows] = compiled.first_mask(buf.shape[1])

    def _accept_par(self, grammars: list[SequenceGrammar], tokens: list[int],
                    matchers: list | None = None) -> bool:
        """Each of ``grammars`` (in template order, so that each thread takes a contiguous
        run of one template) accepts its token of ``tokens``, in one parallel call, and notes
        where its grammar ended; whether every row took its token. ``matchers``: the
        grammars' matchers, when the caller has them."""
        if matchers is None:
            matchers = [grammar.matcher for grammar in grammars]
        accepted = self._fill_executor().consume_token_par(list(zip(matchers, tokens)))
        if all(accepted):
            SequenceGrammar.all_accepted(grammars)
            return True
        for grammar, token, ok in zip(grammars, tokens, accepted):
            grammar.accepted(ok, token)
        return False

    def _fill_executor(self) -> Any:
        """llguidance's thread pool of the parallel accept and mask fill."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.fill_threads)
        return self._executor

    def _fill(self, matchers: list, buf: torch.Tensor) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(self._fill_executor(), matchers, buf)

    def close(self) -> None:
        self.settle()
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True)
            self._ahead_pool = None
        self.compiler.close()


@dataclass(slots=True)
class _Running:
    """The ahead fill running: its future, the output of the step whose sampled ids it takes,
    and its plan (whose ``accepted`` event is set once it accepted them)."""

    future: Future
    output: Any
    plan: AheadPlan


def _host_list(tokens: Any) -> list[int]:
    """The previous step's sampled ids as a list of ints (one conversion, not one a row)."""
    return tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
