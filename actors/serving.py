"""A background engine loop that the shards of one actor hand their requests to.

An actor runs ``process_shard`` calls on a few threads (Ray ``max_concurrency``). Each call
hands its requests to the one :class:`EngineServer` of the actor and blocks until they are all
finished, while the loop thread alone drives the engine. A call's requests are validated and
tokenized on the calling thread (``Engine.build_requests``: the engine may still be running the
previous call's) and queued in one go (``Engine.add_requests``), so a step sees all of them or
none. Two ways to share:

- shared (``exclusive=False``): new requests join the running batch between steps, so the
  next shard fills the engine while the previous one finishes its long tail; which requests
  share a step then depends on timing, and float results (logprobs) on batch composition.
- exclusive (``exclusive=True``, the job default): a call waits until the engine is idle,
  its requests are admitted together on a fresh prefix cache, and nothing else is admitted
  until they are done, so the schedule, and every output bit, depend only on the requests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from actors.contract.task import EngineFailure
from actors.engine import profiling
from actors.engine.profiling import LoopProfile

logger = logging.getLogger(__name__)

class _Batch:
    """The requests of one caller and the outputs gathered for them so far."""

    def __init__(self, requests: Sequence[tuple[str, Any, Any]], exclusive: bool) -> None:
        self.requests: Any = requests  # or the engine's BuiltRequests of them
        self.exclusive = exclusive
        self.expected = {rid: int(getattr(params, "n", 1) or 1) for rid, _, params in requests}
        self.received: dict[str, int] = dict.fromkeys(self.expected, 0)
        self.outputs: list[Any] = []
        self.done = threading.Event()
        self.failure: BaseException | None = None
        self.submitted = time.perf_counter()
        self.admitted = 0.0
        self.admitted_wall = 0.0
        self.counters_at_admission: Any = None
        self.stats: dict[str, float] = {}

    def add(self, output: Any) -> None:
        rid = str(output.id)
        self.outputs.append(output)
        # An error output ends the request even if fewer than n came back.
        if getattr(output, "error", None) is not None:
            self.received[rid] = self.expected[rid]
        else:
            self.received[rid] += 1

    def complete(self) -> bool:
        return all(self.received[r] >= n for r, n in self.expected.items())


class EngineServer:
    """Owns an engine (``add_requests`` / ``step`` / ``has_unfinished_requests``) and a thread
    that steps it whenever requests are pending.

    Example:
        >>> server = EngineServer(engine)          # doctest: +SKIP
        >>> outputs = server.run([("r1", "Hello", SamplingParams(max_tokens=4))])  # doctest: +SKIP
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._incoming: list[_Batch] = []
        self._owner: dict[str, _Batch] = {}
        self._exclusive: _Batch | None = None  # the admitted exclusive batch, until it is done
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def run(self, requests: Sequence[tuple[str, Any, Any]], *, exclusive: bool = False,
            stats: dict[str, float] | None = None, built: Any = None) -> list[Any]:
        """Adds ``requests`` (request_id, prompt, params) and blocks until every sample of each
        has finished. Returns their outputs in finishing order. ``exclusive``: run them alone
        on an idle engine with a fresh prefix cache (see the module docstring). ``stats``: a
        dict that receives where the call's time went: ``queued_s`` (waiting to be admitted),
        ``run_s`` (admission to the last output) and the engine's ``steps``, ``busy_s``,
        ``device_wait_s``, ``cpu_s`` and ``seqs`` over ``run_s`` (``Engine.counters``; a shared call's
        figures include the steps it shared). ``built``: what ``Engine.build_requests`` made
        of ``requests`` already (``actors.shard.ShardPrefetch``)."""
        batch = _Batch(requests, exclusive)
        if not batch.expected:
            return []
        build = getattr(self._engine, "build_requests", None)
        if built is not None:
            batch.requests = built
        elif build is not None:  # validated and tokenized here, not on the loop thread
            wall = time.time()
            batch.requests = build(requests)
            profiling.span("build", wall, len(requests))
        with self._cond:
            if self._broken is not None:
                raise EngineFailure(f"engine failed earlier: {self._broken!r}")
            self._incoming.append(batch)
            self._cond.notify()
        batch.done.wait()
        if batch.failure is not None:
            raise EngineFailure(f"engine step failed: {batch.failure!r}") from batch.failure
        if stats is not None:
            stats.update(batch.stats)
        return batch.outputs

    def _admissible(self) -> list[_Batch]:
        """Pops the incoming batches that may join now, in arrival order (with the lock)."""
        taken: list[_Batch] = []
        while self._incoming and self._exclusive is None:
            head = self._incoming[0]
            if head.exclusive and (taken or self._owner
                                   or self._engine.has_unfinished_requests()):
                break  # waits for an idle engine; the loop steps the others until then
            taken.append(self._incoming.pop(0))
            if head.exclusive:
                self._exclusive = head
        return taken

    def _admit(self) -> None:
        with self._cond:
            while True:
                taken = self._admissible()
                if taken or self._engine.has_unfinished_requests():
                    break
                self._cond.wait()
        for batch in taken:
            batch.admitted, batch.admitted_wall = time.perf_counter(), time.time()
            batch.counters_at_admission = self._counters()
            for rid in batch.expected:
                self._owner[rid] = batch
            self._engine.add_requests(batch.requests, fresh_prefix_cache=batch.exclusive)

    def _loop(self) -> None:
        profile = LoopProfile("engine-loop")  # RAYGEN_PROFILE_DIR (actors.engine.profiling)
        profile.start()
        while True:
            try:
                self._admit()
                finished = self._engine.step()
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                logger.exception("engine step failed")
                self._fail(exc)
                return
            touched = set()
            for output in finished:
                batch = self._owner.get(str(output.id))
                if batch is None:
                    logger.warning("output for unknown request %r dropped", output.id)
                    continue
                batch.add(output)
                touched.add(batch)
            for batch in touched:
                if batch.complete():
                    profile.dump()
                    profiling.span("batch", batch.admitted_wall, len(batch.expected))
                    self._release(batch)
            if not self._engine.has_unfinished_requests():
                self._release_stuck()

    def _counters(self) -> Any:
        counters = getattr(self._engine, "counters", None)
        return counters.snapshot() if counters is not None else None

    def _release(self, batch: _Batch) -> None:
        now = time.perf_counter()
        if batch.admitted:
            batch.stats = {"queued_s": batch.admitted - batch.submitted,
                           "run_s": now - batch.admitted}
            before, after = batch.counters_at_admission, self._counters()
            if before is not None and after is not None:
                spent = after.since(before)
                batch.stats.update(steps=spent.steps, busy_s=spent.busy_s,
                                   device_wait_s=spent.device_wait_s, cpu_s=spent.cpu_s,
                                   seqs=spent.seqs)
        for rid in batch.expected:
            self._owner.pop(rid, None)
        if self._exclusive is batch:
            with self._cond:
                self._exclusive = None
        batch.done.set()

    def _release_stuck(self) -> None:
        """Batches still waiting while the engine is empty would wait forever: fail them."""
        stuck = {id(b): b for b in self._owner.values()}
        for batch in stuck.values():
            missing = [r for r, n in batch.expected.items() if batch.received[r] < n]
            batch.failure = RuntimeError(f"engine finished without outputs for {missing[:5]}")
            self._release(batch)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._broken = exc
            pending, self._incoming = self._incoming, []
        for batch in {id(b): b for b in [*self._owner.values(), *pending]}.values():
            batch.failure = exc
            batch.done.set()
        self._owner.clear()


_servers_lock = threading.Lock()


def server_for(owner: Any, engine: Any) -> EngineServer:
    """The one EngineServer of ``owner`` (an actor), created on first use."""
    with _servers_lock:
        server = getattr(owner, "_engine_server", None)
        if server is None:
            server = EngineServer(engine)
            owner._engine_server = server
        return server
