"""A background engine loop, so several shards share one engine at once.

An actor runs ``process_shard`` calls on a few threads (Ray ``max_concurrency``). Each call
hands its requests to the one :class:`EngineServer` of the actor and blocks until they are all
finished, while the loop thread alone drives the engine: it admits new requests between steps,
so the next shard's requests join the running batch while the previous shard still finishes
its long tail, and the engine stays full across shard boundaries.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The engine raised during a step; its state is unknown, so the actor must be replaced."""


class _Batch:
    """The requests of one caller and the outputs gathered for them so far."""

    def __init__(self, requests: Sequence[tuple[str, Any, Any]]) -> None:
        self.expected = {rid: int(getattr(params, "n", 1) or 1) for rid, _, params in requests}
        self.received: dict[str, int] = dict.fromkeys(self.expected, 0)
        self.outputs: list[Any] = []
        self.done = threading.Event()
        self.failure: BaseException | None = None

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
    """Owns an engine (``add_request`` / ``step`` / ``has_unfinished_requests``) and a thread
    that steps it whenever requests are pending.

    Example:
        >>> server = EngineServer(engine)          # doctest: +SKIP
        >>> outputs = server.run([("r1", "Hello", SamplingParams(max_tokens=4))])  # doctest: +SKIP
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._incoming: list[tuple[_Batch, Sequence[tuple[str, Any, Any]]]] = []
        self._owner: dict[str, _Batch] = {}
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def run(self, requests: Sequence[tuple[str, Any, Any]]) -> list[Any]:
        """Adds ``requests`` (request_id, prompt, params) and blocks until every sample of each
        has finished. Returns their outputs in finishing order."""
        batch = _Batch(requests)
        if not batch.expected:
            return []
        with self._cond:
            if self._broken is not None:
                raise EngineFailure(f"engine failed earlier: {self._broken!r}")
            self._incoming.append((batch, requests))
            self._cond.notify()
        batch.done.wait()
        if batch.failure is not None:
            raise EngineFailure(f"engine step failed: {batch.failure!r}") from batch.failure
        return batch.outputs

    def _admit(self) -> None:
        with self._cond:
            while not self._incoming and not self._engine.has_unfinished_requests():
                self._cond.wait()
            incoming, self._incoming = self._incoming, []
        for batch, requests in incoming:
            for rid, prompt, params in requests:
                self._owner[rid] = batch
                self._engine.add_request(rid, prompt, params)

    def _loop(self) -> None:
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
                    for rid in batch.expected:
                        self._owner.pop(rid, None)
                    batch.done.set()
            if not self._engine.has_unfinished_requests():
                self._release_stuck()

    def _release_stuck(self) -> None:
        """Batches still waiting while the engine is empty would wait forever: fail them."""
        with self._cond:
            if self._incoming:
                return
        stuck = {id(b): b for b in self._owner.values()}
        for batch in stuck.values():
            missing = [r for r, n in batch.expected.items() if batch.received[r] < n]
            batch.failure = RuntimeError(f"engine finished without outputs for {missing[:5]}")
            for rid in batch.expected:
                self._owner.pop(rid, None)
            batch.done.set()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._broken = exc
            pending = [b for b, _ in self._incoming]
            self._incoming = []
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
