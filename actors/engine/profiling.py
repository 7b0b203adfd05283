"""Opt-in profile of the thread that steps an engine.

With ``RAYGEN_PROFILE_DIR=<dir>`` in its environment, the thread that drives an engine (an
actor's engine loop, ``benchmarks/job_bench.py``'s bare engine) runs under ``cProfile`` and
writes its cumulative statistics to ``<dir>/<name>-<pid>.pstats`` (read them with
``python -m pstats``) each time it is asked to, so a process that is killed keeps what it had
written. The profiler slows Python code by about half; compare profiles with each other, not
with unprofiled timings.

    >>> profile = LoopProfile("engine-loop")   # doctest: +SKIP
    >>> profile.start()                        # on the stepping thread
    >>> ...                                    # steps
    >>> profile.dump()                         # after a batch: the file is rewritten
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import threading
import time

ENV = "RAYGEN_PROFILE_DIR"


class LoopProfile:
    """cProfile of the calling thread, written to ``<RAYGEN_PROFILE_DIR>/<name>-<pid>.pstats``;
    does nothing when the variable is unset or empty."""

    def __init__(self, name: str) -> None:
        directory = os.environ.get(ENV, "")
        self.path = os.path.join(directory, f"{name}-{os.getpid()}.pstats") if directory else None
        self._profile: cProfile.Profile | None = None

    def start(self) -> None:
        """Starts profiling the calling thread (the one that steps the engine)."""
        if self.path is None or self._profile is not None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._profile = cProfile.Profile()
        self._profile.enable()

    def dump(self) -> None:
        """Writes the statistics gathered so far (the file is replaced); profiling goes on."""
        if self._profile is None:
            return
        self._profile.disable()
        try:
            self._profile.dump_stats(self.path)
        finally:
            self._profile.enable()


TRACE_ENV = "RAYGEN_TRACE_DIR"


class Trace:
    """Opt-in timeline of a process's engine work, for finding where a job's time goes.

    With ``RAYGEN_TRACE_DIR=<dir>``, ``trace`` (the process's one instance, None otherwise)
    records every engine step (``Engine.step``: its end on the wall clock, host seconds,
    seconds waiting for the device, the thread's CPU seconds, tokens scheduled), every
    collection of the cyclic garbage collector (generation, seconds, thread) and spans of
    work (:func:`span`: a shard's phases, an engine server's batches); ``dump()`` writes them
    to ``<dir>/trace-<pid>.json`` (replaced each time, so a killed process keeps what it had
    written): a shard dumps after writing its part. Each record costs a tuple append.
    ``benchmarks/job_bench.py`` passes the variable on to the bare engine and the actors.

        RAYGEN_TRACE_DIR=$OUT/trace python3 benchmarks/job_bench.py --max-actors 1 ..."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"trace-{os.getpid()}.json")
        self.steps: list[tuple] = []
        self.events: list[tuple] = []
        self._gc_started: dict[int, float] = {}
        self._dump_lock = threading.Lock()  # shard threads of one actor may dump at once
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._gc_started[ident] = time.time()
            return
        started = self._gc_started.pop(ident, None)
        if started is not None:
            self.events.append(("gc", threading.current_thread().name, started, time.time(),
                                info.get("generation"), info.get("collected")))

    def step(self, end: float, host_s: float, wait_s: float, cpu_s: float,
             tokens: int) -> None:
        self.steps.append((end, host_s, wait_s, cpu_s, tokens))

    def event(self, kind: str, start: float, end: float, detail: object = None) -> None:
        """A span of work on the calling thread (wall-clock ``time.time()`` seconds)."""
        self.events.append((kind, threading.current_thread().name, start, end, detail))

    def close(self) -> None:
        """Stops recording collections (the steps and events recorded stay)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def dump(self) -> None:
        with self._dump_lock:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            temp = f"{self.path}.tmp"
            with open(temp, "w") as f:
                json.dump({"pid": os.getpid(), "steps": list(self.steps),
                           "events": list(self.events)}, f)
            os.replace(temp, self.path)


def span(kind: str, start: float, detail: object = None) -> None:
    """Records a span from ``start`` (``time.time()``) to now on the process's trace, if
    there is one (``RAYGEN_TRACE_DIR``)."""
    if trace is not None:
        trace.event(kind, start, time.time(), detail)


trace: Trace | None = Trace(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None
