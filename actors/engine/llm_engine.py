"""The engine: requests in, finished ``GenerationOutput`` rows out, one ``step()`` at a time.

A step schedules work (continuous batching over a paged KV cache), launches it on the device,
and only then reads back the *previous* step's sampled tokens to detokenize and check stops,
so on a GPU the host work overlaps the device work. Tokens a step sampled for a sequence that
the previous step finished are dropped.

Threading: ``add_request`` and ``abort_request`` may be called from any thread at any time
(they queue; the next ``step()`` applies them). ``step()`` and ``generate()`` are serialised
by a lock; one thread should drive the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, Mapping

from actors.engine import profiling
from actors.engine.builder import EngineParts, build_engine_parts
from actors.engine.cpu_threads import engine_cpu_threads
from actors.engine.engine_config import EngineConfig
from actors.engine.executor import InflightStep, StepExecutor
from actors.engine.generation_output import GenerationOutput
from actors.engine.intake import BuiltRequests, RequestIntake
from actors.engine.request_book import RequestBook
from actors.engine.sequence import Sequence
from actors.engine.sleep import SleepController
from actors.engine.step_counters import StepCounters
from actors.engine.structured import StructuredOutputs
from actors.engine.warm_up import warm_up_requests
from actors.engine.weights import WeightLoader, WeightPayload, as_tensor_pairs
from sampler.seeding import sample_seed

logger = logging.getLogger(__name__)

__all__ = ["BuiltRequests", "Engine", "EngineConfig", "StepCounters"]


class Engine:
    """Continuous-batching generation over one model.

    Args:
        model: local directory or hub id.
        config: an ``EngineConfig``, a dict of its fields, or None.

    Example:
        >>> engine = Engine("/tmp/tiny-llama", {"max_num_seqs": 8})  # doctest: +SKIP
        >>> outs = engine.generate([("a", "Hello", {"max_tokens": 4, "seed": 1})])  # doctest: +SKIP
    """

    def __init__(self, model: str, config: EngineConfig | Mapping[str, Any] | None = None):
        self.config = EngineConfig.coerce(config)
        # set here (the model loads on this thread) and by each thread that steps the engine
        self.cpu_threads = engine_cpu_threads(self.config.device, self.config.cpu_threads,
                                              self.config.tensor_parallel_size)
        if self.cpu_threads.count is not None:  # the other ranks take the same count
            self.config = self.config.replace(cpu_threads=self.cpu_threads.count)
        self.replica = None  # actors.engine.parallel.replica.Replica with tensor parallelism
        if self.config.tensor_parallel_size > 1:
            from actors.engine.parallel.replica import Replica

            self.replica = Replica(str(model), self.config)
        try:
            parts: EngineParts = build_engine_parts(
                str(model), self.config, self.replica.comm if self.replica else None)
        except BaseException:
            self.close()
            raise
        self.model_name = str(model)
        self.startup = parts.startup  # seconds of each build phase
        self.loaded = parts.loaded
        self.tokenizer = parts.loaded.tokenizer
        self.max_model_len = parts.max_model_len
        self.kv_cache = parts.kv_cache
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.inputs = parts.inputs
        self.outputs = parts.outputs
        self.structured = StructuredOutputs(
            self.tokenizer, vocab_size=self.loaded.vocab_size,
            eos_token_ids=self.sampler.eos_token_ids, device=self.sampler.device,
            max_num_seqs=self.config.max_num_seqs)
        self.executor = StepExecutor(parts.runner, parts.sampler, self.config.prompt_logprobs_chunk,
                                     self.structured)
        self._inflight: InflightStep | None = None
        self.intake = RequestIntake(self.inputs, self.sampler)
        self.book = RequestBook(self.intake, self.scheduler, self.sampler, self.outputs,
                                self.structured, self.inputs)
        self._step_lock = threading.RLock()
        self.weights = WeightLoader(self.loaded.model, parts.shard_slices)
        self.memory = SleepController(self.kv_cache, self.weights, parts.runner)
        self._blocked: str | None = None  # why steps cannot run (asleep, weights missing)
        self.counters = StepCounters()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Any, prompt: Any, params: Any = None, *,
                    token_logprobs: bool = False) -> None:
        """Queues a request (thread-safe; never raises for bad request data: a bad request
        comes back from ``step()`` as one ``finish_reason="error"`` output per sample).
        ``token_logprobs`` also records each sampled token's ``raw_logprobs`` and
        ``temperature_logprobs`` (``GenerationOutput`` attributes of those names)."""
        self.intake.put(("add", request_id, prompt, params, bool(token_logprobs)))

    def build_requests(self, requests: Iterable[tuple[Any, Any, Any]], *,
                       token_logprobs: bool = False) -> BuiltRequests:
        """Validates and tokenizes ``[(request_id, prompt, params)]`` on the calling thread
        for a later ``add_requests`` (thread-safe; never raises for bad request data: those
        requests come back from ``step()`` as error outputs, as with ``add_request``). The
        stepping thread then only queues them: an engine server builds the next batch on the
        thread that hands it in, while the engine still runs the previous one."""
        return self.intake.build_all(requests, token_logprobs=token_logprobs)

    def add_requests(self, requests: Iterable[tuple[Any, Any, Any]] | BuiltRequests, *,
                     fresh_prefix_cache: bool = False) -> None:
        """Queues ``[(request_id, prompt, params)]`` (or what ``build_requests`` made of
        them) in one go (thread-safe): the next ``step()`` admits all of them, so no step
        ever sees part of the batch. ``fresh_prefix_cache`` first forgets the prefix cache
        (waiting for a running step); called while no request is unfinished, it makes the
        batch's schedule, and so its results, depend on the batch alone and not on what ran
        before it."""
        if fresh_prefix_cache:
            with self._step_lock:
                self.scheduler.bm.reset_prefix_cache()
        self.intake.extend(requests)

    def abort_request(self, request_id: Any) -> None:
        """Stops a request; its samples come back from ``step()`` with finish_reason "abort"
        (thread-safe; unknown or finished ids are ignored)."""
        self.intake.put(("abort", request_id, None, None))

    def has_unfinished_requests(self) -> bool:
        return (self.intake.pending()
                or bool(self.book.requests or self.book.ready or self._inflight is not None))

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[GenerationOutput]:
        """Runs one step; returns the outputs of the samples that finished (or failed)."""
        with self._step_lock:
            self.cpu_threads.enter()
            started, cpu_started = time.perf_counter(), time.thread_time()
            wait_before, cpu_before = self.counters.device_wait_s, self.counters.cpu_s
            if self._blocked is not None and self.has_unfinished_requests():
                raise RuntimeError(self._blocked)
            if self.replica is not None:
                self.replica.check_alive()
            book = self.book
            book.take_intake()
            if book.compiling:
                book.check_compiled()
            sched = self.scheduler.schedule()
            if sched.is_empty and self._inflight is None and book.compiling:
                # nothing can run until a constraint compiles: wait for one, not spin
                self.structured.wait_any([r.grammar for r in book.compiling], timeout=0.05)
            if sched.released_slots:
                self.sampler.remove_requests(sched.released_slots)
            if sched.admitted:
                self._admit_to_sampler(sched.admitted)
            launched = self._inflight = self._launch(sched)
            book.take_intake()  # the next step's admissions, built while the device runs
            ready = book.take_ready()
            counters = self.counters
            if launched is not None:
                counters.steps += 1
                counters.seqs += len(sched.seqs)
            busy = time.perf_counter() - started
            counters.busy_s += busy
            counters.cpu_s += time.thread_time() - cpu_started
            if profiling.trace is not None:  # RAYGEN_TRACE_DIR: a timeline for diagnosis
                profiling.trace.step(time.time(), busy, counters.device_wait_s - wait_before,
                                     counters.cpu_s - cpu_before, sum(sched.num_new))
            return ready

    def _admit_to_sampler(self, seqs: list[Sequence]) -> None:
        """The sequences a step admits take their sampler slots, one write for them all."""
        outputs, structured = self.outputs, self.structured
        for seq in seqs:
            outputs.start(seq)
            if seq.request.grammar is not None:
                structured.start(seq)
        requests = [seq.request for seq in seqs]
        self.sampler.add_requests(
            [seq.slot for seq in seqs], [r.sampler_rows for r in requests],
            [r.prompt_array for r in requests],
            # each sample draws from its own seed (stream 0): alone with n=1 it draws the same
            seeds=[sample_seed(r.seed, seq.sample_index) for r, seq in zip(requests, seqs)],
            sample_indices=[0] * len(seqs),
            output_token_ids=[seq.output_token_ids for seq in seqs])

    def _launch(self, sched) -> InflightStep | None:
        """Launches ``sched`` (None when it is empty) and processes the step before it
        (``_inflight``). When the sampler's launch waits for the masks the previous step's
        tokens lead to (the ahead fill of structured outputs), the previous step is
        processed between the forward's launch and the sampler's, while the device runs the
        forward and the masks fill, so that after the sampler's launch the host only has the
        next forward to launch; the sequences that finished are freed after the sampler's
        launch (their slots are in it). Otherwise the whole step is launched first."""
        executor, prev = self.executor, self._inflight
        if (prev is None or not sched.sample_seqs
                or not self.structured.filling_after(prev.output)):
            launched = None if sched.is_empty else executor.launch(sched, prev)
            if prev is not None:
                self.book.release(self._process(prev))
                self.structured.settle(prev.output)  # a fill no step after it took: joined
            return launched
        launched, inputs, logits = executor.launch_model(sched, prev)
        finished = self._process(prev)
        try:
            executor.sample(sched, inputs, logits, launched, prev)
        finally:
            self.book.release(finished)
        return launched

    def _process(self, step: InflightStep) -> list[Sequence]:
        """Reads a launched step back: prompt logprobs, sampled tokens, finished sequences'
        outputs; returns the sequences that finished, for :meth:`RequestBook.release`. With
        an ahead fill after the step it waits only for that fill's accept of the step's
        tokens (``StructuredOutputs.wait_accepted``), not for the masks after them."""
        for scores in step.prompt_scores:
            host = scores.output.get()
            self.outputs.record_prompt_logprobs(
                scores.request, scores.positions, host.logprobs, host.topk_ids, host.topk_values)
        if step.output is None:
            return []
        self.structured.wait_accepted(step.output)
        waited, cpu_waited = time.perf_counter(), time.thread_time()
        host = step.output.get()
        counters = self.counters
        counters.device_wait_s += time.perf_counter() - waited
        counters.cpu_s -= time.thread_time() - cpu_waited  # a spinning wait is not host work
        tokens = host.token_ids.tolist()
        extra = step.token_logprobs.get().token_ids.tolist() \
            if step.token_logprobs is not None else None
        outputs = self.outputs
        done = outputs.apply_step(step.sample_seqs, step.pending_pos, tokens, extra,
                                  host.logprobs, host.ranks, host.topk_ids, host.topk_values)
        if done:  # after the logprobs: a finished sequence's output is built now
            self.book.ready += self.book.finish_all(done, outputs.top_logprobs_of(done))
        return done

    # ------------------------------------------------------------------ conveniences
    def generate(self, requests: Iterable[tuple[Any, Any, Any]], *,
                 token_logprobs: bool = False) -> list[GenerationOutput]:
        """Runs ``[(request_id, prompt, params)]`` to completion; returns their outputs in
        request order, then sample_index. Outputs of other requests finishing meanwhile are
        kept for the next ``step()``. ``token_logprobs``: as in ``add_request``."""
        requests = list(requests)
        order = {rid: i for i, (rid, _, _) in enumerate(requests)}
        if len(order) != len(requests):
            raise ValueError("generate: request ids must be unique")
        with self._step_lock:
            if self._blocked is not None:
                raise RuntimeError(self._blocked)
            for rid, prompt, params in requests:
                self.add_request(rid, prompt, params, token_logprobs=token_logprobs)
            mine: list[GenerationOutput] = []
            others: list[GenerationOutput] = []
            answered: set = set()  # a request is done once it has outputs and is not running
            while True:
                for out in self.step():
                    if out.id in order:
                        mine.append(out)
                        answered.add(out.id)
                    else:
                        others.append(out)
                if len(answered) == len(order) and not any(rid in self.book.requests
                                                           for rid in order):
                    break
            self.book.ready = others + self.book.ready
        mine.sort(key=lambda o: (order[o.id], o.sample_index))
        return mine

    def warm_up(self) -> float:
        """Runs a full batch (``max_num_seqs``) of short requests through the engine, cycling
        six kinds (greedy, seeded top-p, top-k, min-p with top-k and top-p, top-k logprobs,
        sampled-token logprob), so the first real batch does not pay for compiling or
        loading kernels, nor for growing the host buffers and pools to its size; then forgets
        their prefix cache. Returns the seconds it took."""
        started = time.perf_counter()
        self.generate(warm_up_requests(self.loaded.vocab_size, self.config.max_num_seqs,
                                       self.config.max_logprobs))
        self.reset_prefix_cache()
        return time.perf_counter() - started

    # ------------------------------------------------------------------ RL: weights, memory
    def update_weights(self, weights: Any) -> dict[str, Any]:
        """Copies new weights into the model in place (nothing is read from disk) and resets
        the prefix cache. ``weights``: a state dict, an ``actors.engine.weights.WeightPayload`` or an
        iterable of ``(name, tensor)`` pairs, with Hugging Face state-dict names (a subset is
        fine: e.g. one checkpoint shard per call; tied names load the same tensor).

        Returns ``{"num_tensors", "num_bytes", "seconds"}``. Raises ``ValueError`` naming the
        tensor for an unknown name, a wrong shape or dtype; ``RuntimeError`` while requests
        are unfinished or the weights' memory is asleep (level 2: ``wake_up()`` first).
        """
        with self._step_lock:
            self.cpu_threads.enter()
            self._quiesce("update_weights")
            try:
                if self.replica is None:
                    return self.weights.load(weights)
                items = as_tensor_pairs(weights)  # full tensors: every rank takes its slice
                whole = isinstance(weights, (Mapping, WeightPayload))  # all or nothing
                stats = self.weights.load(weights if whole else items)  # checked on rank 0
                self.replica.send_weights(items)
                return stats
            finally:  # also after a partial (iterator) update that failed midway
                self.scheduler.bm.reset_prefix_cache()
                self._blocked = self.memory.blocked_reason()

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Frees device memory of an idle engine: level 1 the KV cache, level 2 also the
        weights (reload them with ``update_weights`` after ``wake_up``). Returns the bytes
        freed, ``{"kv_cache": ..., "weights": ...}``; steps refuse to run until woken."""
        with self._step_lock:
            self._quiesce("sleep")
            freed = self.memory.sleep(level)
            if self.replica is not None:
                self.replica.sleep(level)
            self.scheduler.bm.reset_prefix_cache()
            self._blocked = self.memory.blocked_reason()
            return freed

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Re-allocates what ``sleep`` freed (``tags`` ⊆ {"weights", "kv_cache"}; None: all)
        and, on CUDA, captures the decode graphs again."""
        with self._step_lock:
            self.memory.wake_up(tags)
            if self.replica is not None:
                self.replica.wake_up(tags)
            self._blocked = self.memory.blocked_reason()

    def close(self) -> None:
        """Ends the other tensor-parallel ranks (idempotent; also done when the engine is
        garbage-collected) and the threads of structured outputs."""
        structured = getattr(self, "structured", None)  # None when the build failed
        if structured is not None:
            structured.close()
        if self.replica is not None:
            self.replica.close()

    def reset_prefix_cache(self) -> None:
        """Forgets the prefix cache (cached KV computed with other weights is never reused).
        With tensor parallelism the cache lives on rank 0 alone: the other ranks only run the
        block tables rank 0 sends."""
        with self._step_lock:
            self.scheduler.bm.reset_prefix_cache()

    def _quiesce(self, what: str) -> None:
        """Raises unless no request is unfinished; reads back a step still in flight."""
        if self.intake.pending() or self.book.requests:
            raise RuntimeError(f"{what}: the engine has unfinished requests; wait for them or "
                               "abort them first")
        while self._inflight is not None:
            self.book.ready = self.step() + self.book.ready

    def info(self) -> dict[str, Any]:
        """Model and engine facts."""
        return {
            "model": self.model_name,
            "architecture": self.loaded.architecture,
            "device": str(self.loaded.device),
            "dtype": str(self.loaded.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(self.kv_cache.pool.dtype).replace("torch.", ""),
            "vocab_size": self.loaded.vocab_size,
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.kv_cache.num_blocks,
            "block_size": self.kv_cache.block_size,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            **self.executor.runner.describe(),
            "sleep_level": self.memory.level,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "quantization": self.loaded.quantization,
            "cpu_threads": self.cpu_threads.count,  # None: torch's own (a GPU engine)
        }

    @property
    def stats(self):
        """Scheduler counters (prompt tokens computed, cached, preemptions, steps)."""
        return self.scheduler.stats
