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
import os

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
