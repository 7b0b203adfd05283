"""Intra-op threads of a CPU engine: how many, and on which threads they are set.

A CPU engine runs torch's intra-op work (OpenMP, MKL) on ``EngineConfig.cpu_threads`` threads,
or, when that is None, on its process's CPU share: a Ray actor's assigned CPUs, else the CPUs
the process may run on, divided by the engine's tensor-parallel ranks, and never more than
``OMP_NUM_THREADS`` when that is set. A GPU engine's threads are left as they are unless
``cpu_threads`` is set.

``torch.set_num_threads`` sets the calling thread's OpenMP count and the count a thread takes
at its first parallel torch op; a thread that ran one before keeps the count it took then. So
the count is set on each thread that runs the engine (``CPUThreads.enter``, once per thread).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading

import torch

logger = logging.getLogger(__name__)


def cpu_share() -> tuple[int, str]:
    """``(cpus, where from)``: the CPUs Ray assigned to this actor or task (rounded down, at
    least 1), else the CPUs this process may run on."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is no Ray worker
    if ray is not None and ray.is_initialized():
        try:  # only a worker (an actor or a task) has an assignment; a driver raises
            assigned = ray.get_runtime_context().get_assigned_resources().get("CPU")
        except Exception:  # noqa: BLE001 - a driver, or an older Ray
            pass
        else:  # an actor that reserved no CPU counts as one, as Ray's OMP_NUM_THREADS does
            return max(1, math.floor(assigned or 1)), "the Ray worker's num_cpus"
    return usable_cpus(), "the CPUs this process may use"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the host's CPUs where the platform
    has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_cpu_threads(device: str, cpu_threads: int | None,
                        tensor_parallel_size: int = 1) -> tuple[int | None, str]:
    """``(threads, why)`` for an engine on ``device``: ``cpu_threads`` when set; on a CPU
    engine its share of :func:`cpu_share` per tensor-parallel rank, at most
    ``OMP_NUM_THREADS`` when that is set; None (leave torch as it is) on a GPU engine."""
    if cpu_threads is not None:
        return cpu_threads, "engine.cpu_threads"
    if device != "cpu":
        return None, "a GPU engine"
    cpus, source = cpu_share()
    share = max(1, cpus // tensor_parallel_size)
    why = f"{cpus} CPUs ({source})" + (
        f" over {tensor_parallel_size} ranks" if tensor_parallel_size > 1 else "")
    ceiling = _omp_num_threads()
    if ceiling is not None and ceiling < share:
        return ceiling, f"OMP_NUM_THREADS={ceiling}, below {why}"
    return share, why


def _omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer, else None."""
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return value if value >= 1 else None


class CPUThreads:
    """Sets ``count`` intra-op threads on each thread that calls :meth:`enter` (a no-op when
    ``count`` is None).

    Example:
        >>> threads = CPUThreads(1)
        >>> threads.enter()  # on every thread that runs the engine
        >>> torch.get_num_threads()
        1
    """

    def __init__(self, count: int | None) -> None:
        self.count = count
        self._local = threading.local()

    def enter(self) -> None:
        """Sets the count on the calling thread, the first time this thread calls."""
        if self.count is not None and not getattr(self._local, "set", False):
            torch.set_num_threads(self.count)
            self._local.set = True


def engine_cpu_threads(device: str, cpu_threads: int | None,
                       tensor_parallel_size: int = 1) -> CPUThreads:
    """The engine's :class:`CPUThreads`, entered on the calling thread, the choice logged."""
    count, why = resolve_cpu_threads(device, cpu_threads, tensor_parallel_size)
    threads = CPUThreads(count)
    if count is not None:
        threads.enter()
        logger.info("engine: %d intra-op CPU thread(s) (%s)", count, why)
    return threads
