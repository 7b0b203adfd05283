"""The dispatch loop: a fixed pool of actors pulls shards, dead actors are replaced.

A pool slot is one replica: one actor, or with tensor parallelism (``bundles``) a placement
group of a bundle per rank, rank 0's actor in bundle 0 (it starts the other ranks in theirs).
Either way the slot is started, lost and killed as one unit: killing it removes its group,
which ends every rank.

Each actor holds ``IN_FLIGHT_PER_ACTOR`` shards, so the next one's rows are read and its
requests built while the current one runs. When shards share the engine (``deterministic:
false``), an actor whose shards would not fill its engine takes more: while its shards hold
fewer than ``fill_rows`` rows (the engine's sequences, plus a shard to spare), up to
``MAX_SHARDS_IN_FLIGHT``. Each actor of the first pool gets its first
shard with its constructor call (Ray queues it behind the constructor), and the constructor is
told which it is (``start_actor(first_shard=task)``), so the actor reads its rows while the
model loads and generates the moment its model is up. A shard whose attempt
failed (its actor died, its engine broke, or it raised) is retried alone on an idle actor, so
a later failure is blamed on it and not on a bystander; after ``max_attempts`` its rows are
written as error rows by the driver. A part-file write failure (the output storage) ends the
job, and so does a shard that runs out of attempts before any shard succeeded (a broken setup,
not a bad shard).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.contract.shard_io import write_failed_shard
from actors.contract.task import EngineFailure, PartWriteError, ShardResult, ShardTask
from jobs.cluster import (
    IN_FLIGHT_PER_ACTOR,
    MAX_SHARDS_IN_FLIGHT,
    remove_replica_group,
    replica_group,
    wait_until_dead,
)

logger = logging.getLogger(__name__)

MakeTask = Callable[[int, int], ShardTask]  # (shard id, attempt) -> task
Commit = Callable[[ShardResult, str], None]  # (result, actor name) -> None


def shards_at_once(fill_rows: int) -> int:
    """The most shards the dispatcher gives one actor at once (its Ray ``max_concurrency``
    must allow as many ``process_shard`` calls): ``IN_FLIGHT_PER_ACTOR``, or up to
    ``MAX_SHARDS_IN_FLIGHT`` when shards share the engine (``fill_rows`` > 0)."""
    return MAX_SHARDS_IN_FLIGHT if fill_rows else IN_FLIGHT_PER_ACTOR


@dataclass(slots=True)
class _Slot:
    name: str
    handle: Any = None
    group: Any = None  # the replica's placement group (tensor parallelism)
    ready: Any = None  # the readiness ref while the actor starts
    inflight: dict[Any, ShardTask] = field(default_factory=dict)
    exclusive: bool = False  # running a retried shard alone
    deaths: int = 0
    failed_starts: int = 0  # consecutive starts that died before the actor was ready


def _startup_text(facts: Any) -> str:
    """`` (startup: process age 18.2 s, ...)`` from an actor's ``startup_report``, or ""."""
    if not isinstance(facts, dict):
        return ""
    parts = [f"{k.replace('_', ' ')} {v:.1f} s" for k, v in facts.items() if v is not None]
    return f" (startup: {', '.join(parts)})" if parts else ""


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Dispatcher:
    """Runs shards on an actor pool until each is committed (or written as error rows).

    ``start_actor(first_shard=..., placement_group=...)`` starts a slot's actor (the group
    only with ``bundles``: a tensor-parallel replica's placement group, one per slot start).
    """

    def __init__(self, start_actor: Callable[..., Any], num_actors: int, make_task: MakeTask,
                 commit: Commit, max_attempts: int, fill_rows: int = 0,
                 on_ready: Callable[[str], None] | None = None,
                 bundles: list[dict[str, float]] | None = None) -> None:
        self._start_actor = start_actor
        self._bundles = bundles
        self._on_ready_hook = on_ready  # called with a slot's name when its actor is up
        self._fill_rows = fill_rows
        self._most = shards_at_once(fill_rows)
        self._slots = [_Slot(f"actor-{i}") for i in range(num_actors)]
        self._make_task = make_task
        self._commit = commit
        self._max_attempts = max_attempts
        self._pending: deque[tuple[int, int]] = deque()
        self._retry: deque[tuple[int, int]] = deque()
        self.retried: set[int] = set()
        self.failed: set[int] = set()
        self.succeeded = 0

    @property
    def actors(self) -> list[str]:
        """The names of the pool's slots (``actor-0``, ``actor-1``, …); a replaced actor keeps
        its slot's name."""
        return [slot.name for slot in self._slots]

    def run(self, shard_ids: list[int]) -> None:
        """Processes ``shard_ids`` in order; returns when all are committed."""
        import ray

        self._pending.extend((s, 1) for s in shard_ids)
        if not self._pending:
            return
        try:
            for slot in self._slots:
                # queued behind its constructor: starts when the model is up
                first = self._make_task(*self._pending.popleft()) if self._pending else None
                self._launch(slot, first)
                if first is not None:
                    self._submit_task(slot, first, exclusive=False)
            while self._pending or self._retry or any(s.inflight for s in self._slots):
                self._assign()
                waiting = {ref: slot for slot in self._slots
                           for ref in ([slot.ready] if slot.ready else list(slot.inflight))}
                done, _ = ray.wait(list(waiting), num_returns=1, timeout=5.0)
                for ref in done:
                    slot = waiting[ref]
                    if ref is slot.ready:
                        self._on_ready(slot, ref)
                    else:
                        self._on_done(slot, ref)
        finally:
            handles = [slot.handle for slot in self._slots if slot.handle is not None]
            for slot in self._slots:
                self._kill(slot)
            wait_until_dead(handles)

    # ------------------------------------------------------------------ actors
    def _launch(self, slot: _Slot, first_shard: ShardTask | None = None) -> None:
        if self._bundles:
            slot.group = replica_group(self._bundles)
            slot.handle = self._start_actor(first_shard=first_shard, placement_group=slot.group)
        else:
            slot.handle = self._start_actor(first_shard=first_shard)
        # the actor's startup report (when it has one) doubles as the readiness call
        ready = getattr(slot.handle, "startup_report", None) or slot.handle.__ray_ready__
        slot.ready = ready.remote()
        slot.exclusive = False

    def _on_ready(self, slot: _Slot, ref: Any) -> None:
        import ray

        try:
            facts = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the actor died while starting
            if getattr(exc, "actor_init_failed", False):  # its constructor raised
                lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
                raise RuntimeError(f"{slot.name} failed to start: {lines[-1].strip()}") from exc
            slot.failed_starts += 1
            if slot.failed_starts >= self._max_attempts:
                raise RuntimeError(f"{slot.name} failed to start {slot.failed_starts} times, "
                                   f"last: {_first_line(exc)}") from exc
            logger.warning("%s died while starting (%s); starting it again", slot.name,
                           _first_line(exc))
            # a shard queued behind the constructor never ran: it goes back, not counted as
            # an attempt
            self._pending.extendleft((t.shard_id, t.attempt)
                                     for t in reversed(list(slot.inflight.values())))
            slot.inflight.clear()
            self._kill(slot)
            self._launch(slot)
            return
        slot.ready = None
        slot.failed_starts = 0
        logger.info("%s ready%s", slot.name, _startup_text(facts))
        if self._on_ready_hook is not None:
            self._on_ready_hook(slot.name)

    def _kill(self, slot: _Slot) -> None:
        import ray

        if slot.handle is not None:
            ray.kill(slot.handle, no_restart=True)
            slot.handle = None
        if slot.group is not None:  # ends the replica's other ranks
            remove_replica_group(slot.group)
            slot.group = None

    def _lose_actor(self, slot: _Slot, tasks: list[ShardTask], exc: BaseException) -> None:
        tasks = tasks + list(slot.inflight.values())
        slot.inflight.clear()
        slot.deaths += 1
        logger.warning("%s lost (%s); retrying shards %s on a new actor", slot.name,
                       _first_line(exc), [t.shard_id for t in tasks])
        self._kill(slot)
        self._launch(slot)
        for task in tasks:
            self._attempt_failed(task, f"{slot.name} died ({_first_line(exc)})")

    # ------------------------------------------------------------------ shards
    def _submit(self, slot: _Slot, shard_id: int, attempt: int, exclusive: bool) -> None:
        self._submit_task(slot, self._make_task(shard_id, attempt), exclusive)

    def _submit_task(self, slot: _Slot, task: ShardTask, exclusive: bool) -> None:
        slot.inflight[slot.handle.process_shard.remote(task)] = task
        slot.exclusive = exclusive

    def _assign(self) -> None:
        ready = [s for s in self._slots if s.ready is None and not s.exclusive]
        drain = None
        if self._retry:
            for slot in ready:
                if not slot.inflight and self._retry:
                    self._submit(slot, *self._retry.popleft(), exclusive=True)
            if self._retry:  # let one busy actor run dry so a retry can go next
                busy = [s for s in ready if not s.exclusive]
                drain = min(busy, key=lambda s: len(s.inflight)) if busy else None
        for slot in ready:
            while (not slot.exclusive and slot is not drain and self._pending
                   and self._wants_more(slot)):
                self._submit(slot, *self._pending.popleft(), exclusive=False)

    def _wants_more(self, slot: _Slot) -> bool:
        """Whether ``slot`` takes another shard: below ``IN_FLIGHT_PER_ACTOR`` shards always,
        beyond that while its shards' rows stay under ``fill_rows``."""
        held = len(slot.inflight)
        if held < IN_FLIGHT_PER_ACTOR:
            return True
        return held < self._most and \
            sum(t.row_stop - t.row_start for t in slot.inflight.values()) < self._fill_rows

    def _on_done(self, slot: _Slot, ref: Any) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        task = slot.inflight.pop(ref)
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            self._lose_actor(slot, [task], exc)
            return
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, PartWriteError):
                raise OSError(f"output: {cause}") from None
            if isinstance(cause, EngineFailure):
                self._lose_actor(slot, [task], exc)
                return
            if not slot.inflight:
                slot.exclusive = False
            self._attempt_failed(task, _first_line(exc))
            return
        if not slot.inflight:
            slot.exclusive = False
        self.succeeded += 1
        self._commit(result, slot.name)

    def _attempt_failed(self, task: ShardTask, reason: str) -> None:
        self.retried.add(task.shard_id)
        if task.attempt < self._max_attempts:
            logger.warning("shard %d attempt %d failed: %s", task.shard_id, task.attempt, reason)
            self._retry.append((task.shard_id, task.attempt + 1))
            return
        if not self.succeeded:  # nothing works at all: a broken setup, not a bad shard
            raise RuntimeError(f"shard {task.shard_id} failed {task.attempt} times before any "
                               f"shard succeeded, so the job stops (committed shards are kept "
                               f"for a rerun): {reason}")
        logger.error("shard %d failed %d times, writing its rows as errors: %s",
                     task.shard_id, task.attempt, reason)
        self.failed.add(task.shard_id)
        message = f"shard failed after {task.attempt} attempts, last: {reason}"
        self._commit(write_failed_shard(task, message), "driver")
