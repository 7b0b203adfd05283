"""Structured outputs in the engine: constraints compiled off the stepping thread, one
grammar matcher per sequence, and each step's packed token masks.

``StructuredOutputs.submit`` compiles a request's constraint once per distinct constraint
(a cache keyed by its canonical text) on a small thread pool; the scheduler admits the
request only once its future is done, and a constraint that does not compile becomes the
request's error before any device work. Each sequence (each of n samples) gets its own
matcher (:class:`SequenceGrammar`), which accepts the sequence's output tokens in order and
only once (``num_accepted``), so preemption and recompute never lose or double a token.
``step_mask`` runs while the step's forward is on the device: it reads the previous step's
sampled ids (the async copy), advances the matchers (one parallel llguidance call for the
rows that take one token), fills the masks of the constrained rows in one parallel call into
a pinned host buffer and uploads it without blocking. Library choice and measurements:
docs/structured_outputs.md.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait, FIRST_COMPLETED
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import numpy as np
import torch

from actors.engine.cpu_threads import usable_cpus
from actors.engine.sequence import PENDING, Sequence
from sampler.grammar_mask import StepBitmask
from sampler.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


ROWS_PER_TEMPLATE = 32  # sequences of one constraint per independent matcher template


@dataclass(slots=True)
class CompiledConstraint:
    """A compiled constraint: matcher templates to copy per sequence, or why it failed.

    Copies of one llguidance matcher share its lexer and its caches behind a lock, so many
    rows of one constraint filled in parallel wait on each other; a constraint with many
    live sequences gets up to one template per fill thread (each compiled from ``grammar``
    on first need, ~1 ms), and its sequences are spread over them."""

    template: Any = None  # llguidance.LLMatcher in its initial state
    error: str | None = None
    grammar: str = ""  # the llguidance grammar text it was compiled from
    templates: list = field(default_factory=list)  # the templates after ``template``
    num_started: int = 0  # sequences given a copy so far

    def next_copy(self, tokenizer: Any, max_templates: int) -> tuple[Any, int]:
        """A fresh matcher for one more sequence and the index of its template."""
        import llguidance

        index = (self.num_started // ROWS_PER_TEMPLATE) % max(1, max_templates)
        self.num_started += 1
        if index == 0:
            return self.template.deep_copy(), 0
        while len(self.templates) < index:
            self.templates.append(llguidance.LLMatcher(tokenizer, self.grammar, log_level=0))
        return self.templates[index - 1].deep_copy(), index


class SequenceGrammar:
    """The matcher of one sequence and how many of its output tokens it accepted."""

    __slots__ = ("matcher", "num_accepted", "error", "group")

    def __init__(self, matcher: Any, group: int = 0) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.error: str | None = None
        self.group = group  # the template it was copied from (fills go in its order)

    def new_tokens(self, seq: Sequence, pending: int = PENDING) -> list[int]:
        """The output tokens of ``seq`` not accepted yet, up to the first unknown one
        (``pending``: the value of a trailing placeholder, when the caller knows it)."""
        tokens = seq.token_ids
        start = seq.num_prompt + self.num_accepted
        if start == len(tokens) - 1 and tokens[start] == PENDING:
            return [] if pending == PENDING else [pending]  # a decode step's one token
        out = []
        for pos in range(start, len(tokens)):
            token = tokens[pos]
            if token == PENDING:
                if pos != len(tokens) - 1 or pending == PENDING:
                    break
                token = pending
            out.append(token)
        return out

    def accept(self, tokens: list[int]) -> None:
        """Advances the matcher over ``tokens`` (a refused token is the sequence's error)."""
        for token in tokens:
            if self.error is None and not self.matcher.consume_token(token):
                self.refused(token)
            self.num_accepted += 1

    def refused(self, token: int) -> None:
        self.error = (f"structured_outputs: token {token} is not allowed by the grammar "
                      f"({self.matcher.get_error()[:200]})")

    def catch_up(self, seq: Sequence, pending: int = PENDING) -> None:
        """Accepts the output tokens of ``seq`` not accepted yet (see :meth:`new_tokens`)."""
        self.accept(self.new_tokens(seq, pending))

    @property
    def is_stopped(self) -> bool:
        """The grammar reached an end where nothing but EOS may follow."""
        return self.matcher.is_stopped()


class StructuredOutputs:
    """Compiler cache, per-sequence matchers and step masks of one engine.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the logits' width (the masks cover it; ids past the tokenizer's are
            never allowed).
        eos_token_ids: the ids that end a text where the grammar may end.
        device: where the sampler runs.
        max_num_seqs: the most rows a step samples.
        num_threads: compile threads.
        fill_threads: threads of the parallel accept and mask fill (default: the cores this
            process may run on less two, 2 to 16); a constraint shared by many sequences
            gets up to this many matcher templates.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Seq[int],
                 device: torch.device, max_num_seqs: int, num_threads: int = 2,
                 fill_threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.num_threads = max(1, num_threads)
        self.fill_threads = fill_threads or max(2, min(16, usable_cpus() - 2))
        self.words = (vocab_size + 31) // 32
        self.num_active = 0  # sequences holding a matcher (host predicate of step_mask)
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._turn = 0

    # ------------------------------------------------------------------ compiling
    def submit(self, so: StructuredOutputsParams) -> Future:
        """The future of ``so``'s :class:`CompiledConstraint` (one compile per distinct
        constraint; any thread)."""
        key = so.key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.num_threads,
                                                    thread_name_prefix="grammar-compile")
                future = self._cache[key] = self._pool.submit(self._compile, so)
            return future

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def _compile(self, so: StructuredOutputsParams) -> CompiledConstraint:
        import llguidance

        from actors.engine.structured_grammar import to_lark

        field = f"sampling_params.structured_outputs.{so.kind}"
        try:
            grammar = to_lark(so)
            tokenizer = self._tokenizer()
            problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            if problem:
                return CompiledConstraint(error=f"{field}: {problem.strip()[:500]}")
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                return CompiledConstraint(error=f"{field}: {matcher.get_error()[:500]}")
            return CompiledConstraint(template=matcher, grammar=grammar)
        except Exception as exc:  # noqa: BLE001 - any failure is this constraint's error
            logger.debug("constraint %s failed to compile", so.key[:200], exc_info=True)
            return CompiledConstraint(error=f"{field}: {type(exc).__name__}: {exc}"[:600])

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
            matcher, group = compiled.next_copy(self._tokenizer(), self.fill_threads)
            seq.grammar = SequenceGrammar(matcher, group)
            self.num_active += 1
        seq.grammar.catch_up(seq)

    def release(self, seq: Sequence) -> None:
        if seq.grammar is not None:
            seq.grammar = None
            self.num_active -= 1

    # ------------------------------------------------------------------ masks
    def step_mask(self, seqs: list[Sequence], prev_tokens) -> StepBitmask | None:
        """The masks of a step's constrained rows (row ``r`` samples ``seqs[r]``), on the
        device; None when no row is constrained.

        Args:
            seqs: the step's sampling sequences.
            prev_tokens: a callable giving the previous step's sampled ids as a host array
                (called only when a constrained row still waits for its last token).
        """
        rows = [r for r, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        host_prev = None
        matchers, singles = [], []
        for j, r in enumerate(rows):
            seq = seqs[r]
            grammar = seq.grammar
            pending = PENDING
            if seq.num_pending:
                if host_prev is None:
                    host_prev = _host_list(prev_tokens())
                pending = host_prev[seq.pending_row]
            todo = grammar.new_tokens(seq, pending)
            if len(todo) == 1 and grammar.error is None:
                singles.append((grammar, todo[0]))  # a decode step: accepted in parallel
            else:
                grammar.accept(todo)
            matchers.append((grammar.matcher, j))
        # rows of one template next to each other: each thread takes a contiguous run
        if len(rows) > ROWS_PER_TEMPLATE:
            groups = [seqs[r].grammar.group for r in rows]
            matchers = [matchers[j] for j in sorted(range(len(rows)), key=groups.__getitem__)]
            singles.sort(key=lambda item: item[0].group)
        if singles:
            accepted = self._fill_executor().consume_token_par(
                [(grammar.matcher, token) for grammar, token in singles])
            for (grammar, token), ok in zip(singles, accepted):
                if not ok:
                    grammar.refused(token)
                grammar.num_accepted += 1
        buf = self._buffer(len(rows))
        self._fill(matchers, buf)
        if self.device.type == "cuda":
            bits = buf.to(self.device, non_blocking=True)
            self._events[self._turn].record()
        else:
            bits = buf.clone()
        return StepBitmask.build(bits, np.asarray(rows, dtype=np.int64), len(seqs),
                                 self.device)

    def _fill_executor(self) -> Any:
        """llguidance's thread pool of the parallel accept and mask fill."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.fill_threads)
        return self._executor

    def _fill(self, matchers: list, buf: torch.Tensor) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(self._fill_executor(), matchers, buf)

    def _buffer(self, rows: int) -> torch.Tensor:
        """A host buffer ``[rows, words]`` for this step's masks: two pinned buffers taken
        in turn on CUDA, each reused once its previous upload finished."""
        if not self._buffers:
            pin = self.device.type == "cuda"
            for _ in range(2 if pin else 1):
                self._buffers.append(torch.zeros((self.max_num_seqs, self.words),
                                                 dtype=torch.int32, pin_memory=pin))
                self._events.append(torch.cuda.Event() if pin else None)
        self._turn = (self._turn + 1) % len(self._buffers)
        if self._events[self._turn] is not None:
            self._events[self._turn].synchronize()
        return self._buffers[self._turn][:rows]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _host_list(tokens: Any) -> list[int]:
    """The previous step's sampled ids as a list of ints (one conversion, not one a row)."""
    return tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
