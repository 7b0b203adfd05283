"""Constraints compiled once per distinct constraint (a cache keyed by its canonical text) on
a small thread pool, off the stepping thread: a :class:`CompiledConstraint` holding the matcher
template of its llguidance grammar, or why the constraint failed (that request's error, found
before any device work).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence as Seq

from actors.engine.structured_sequence import CompiledConstraint
from sampler.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class ConstraintCompiler:
    """One engine's compiled constraints.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the logits' width (ids past the tokenizer's are never allowed).
        eos_token_ids: the ids that end a text where the grammar may end.
        num_threads: compile threads.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Seq[int],
                 num_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.num_threads = max(1, num_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._ll_tokenizer = None

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

    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer of the model (made once; any thread)."""
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
            tokenizer = self.ll_tokenizer()
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

    def close(self) -> None:
        """Stops the compile threads (compiles not started are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
