"""Requests on their way into an engine: handed in from any thread, built (validated,
tokenized, their sampler rows made) on the thread that hands them in or on the stepping
thread, and queued until a step takes them, in order (as many as its next admissions need).

An item of the queue is ``("add", id, prompt, params, token_logprobs)`` (built when taken),
``("built", id, Request)``, ``("reject", id, params, reason)`` or ``("abort", id, None,
None)``. Building never raises for bad request data: a request that cannot run becomes a
"reject" item, which the engine turns into error outputs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from actors.engine.request_builder import InputProcessor
    from sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BuiltRequests:
    """Requests validated and tokenized ahead of ``Engine.add_requests`` (``build_requests``):
    queue items, one per request."""

    items: list[tuple]

    def __len__(self) -> int:
        return len(self.items)


class RequestIntake:
    """The engine's queue of requests and aborts (thread-safe), and how a request is built.

    Args:
        inputs: turns ``(request_id, prompt, params)`` into a ``Request``.
        sampler: checks the parameters against the model and makes the request's slot rows.
    """

    def __init__(self, inputs: InputProcessor, sampler: Sampler) -> None:
        self.inputs = inputs
        self.sampler = sampler
        self._items: list[tuple] = []
        self._aborts = 0  # aborts among the items
        self._lock = threading.Lock()

    def build(self, request_id: Any, prompt: Any, params: Any,
              token_logprobs: bool = False) -> tuple:
        """``("built", id, Request)`` or ``("reject", id, params, reason)``; any thread."""
        try:
            hash(request_id)
        except TypeError:
            return ("reject", request_id, params, f"request id {request_id!r:.80} is not hashable")
        try:
            request = self.inputs.build(request_id, prompt, params, -1)
            request.sampler_rows = self.sampler.prepare(request.params,
                                                        request.bad_words_token_ids)
        except Exception as exc:  # noqa: BLE001 - any bad data fails only this request
            logger.debug("request %r rejected: %s", request_id, exc)
            return ("reject", request_id, params, str(exc))
        request.token_logprobs = token_logprobs
        return ("built", request_id, request)

    def build_all(self, requests: Iterable[tuple[Any, Any, Any]], *,
                  token_logprobs: bool = False) -> BuiltRequests:
        return BuiltRequests([self.build(rid, prompt, params, token_logprobs)
                              for rid, prompt, params in requests])

    def put(self, item: tuple) -> None:
        with self._lock:
            self._items.append(item)
            self._aborts += item[0] == "abort"

    def extend(self, requests: Iterable[tuple[Any, Any, Any]] | BuiltRequests) -> None:
        """Queues ``[(request_id, prompt, params)]`` (built when taken) or built requests,
        in one go."""
        if isinstance(requests, BuiltRequests):
            items = requests.items
        else:
            items = [("add", rid, prompt, params) for rid, prompt, params in requests]
        with self._lock:
            self._items.extend(items)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._items)

    def take(self, limit: int | None = None) -> list[tuple]:
        """Queued items in order, the requests built ("built" / "reject" / "abort" items):
        all of them, or with ``limit`` the first ``limit`` requests with the aborts queued
        before the next one, and in any case every item up to the last queued abort (an
        abort never waits behind requests queued before it); the rest stay queued."""
        with self._lock:
            items = self._items
            cut = len(items)
            if limit is not None:
                requests = 0
                for j, item in enumerate(items):
                    if item[0] != "abort":
                        if requests == limit:
                            cut = j
                            break
                        requests += 1
                if self._aborts:
                    last = max(j for j, item in enumerate(items) if item[0] == "abort")
                    cut = max(cut, last + 1)
            taken, self._items = items[:cut], items[cut:]
            if self._aborts:
                self._aborts -= sum(1 for item in taken if item[0] == "abort")
        return [self.build(*item[1:]) if item[0] == "add" else item for item in taken]
