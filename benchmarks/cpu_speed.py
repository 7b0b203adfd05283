"""The benchmark machine's CPUs: each one's single-thread speed (a shared virtual machine's
vCPUs differ), the CPUs a ``--cpus`` option names, and the CPUs a process may run on."""

from __future__ import annotations

import os
import time


def _spin(n: int = 60_000) -> float:
    """Seconds of a fixed pure-Python loop (dict, list and str work, like the engine's host
    side)."""
    t0 = time.perf_counter()
    d: dict[int, str] = {}
    out = []
    for i in range(n):
        d[i & 1023] = str(i)
        out.append(len(d[i & 511]))
    return time.perf_counter() - t0


def probe_cpus(cpus: list[int] | None = None, rounds: int = 3) -> dict[int, float]:
    """Milliseconds of :func:`_spin` on each allowed CPU, this thread pinned to it in turn
    (the fastest of ``rounds``); the affinity is restored afterwards. On a shared virtual
    machine the vCPUs differ in single-thread speed, and the engine's host side runs at the
    speed of the one its thread lands on."""
    allowed = sorted(os.sched_getaffinity(0))
    out: dict[int, float] = {}
    try:
        for cpu in cpus if cpus is not None else allowed:
            os.sched_setaffinity(0, {cpu})
            out[cpu] = round(1e3 * min(_spin() for _ in range(rounds)), 2)
    finally:
        os.sched_setaffinity(0, allowed)
    return out


def choose_cpus(spec: str, speeds: dict[int, float]) -> list[int]:
    """The CPUs of ``--cpus``: "fastest:N" (the N fastest of ``speeds``) or a list like
    "0,2-3"."""
    if spec.startswith("fastest:"):
        n = int(spec.split(":", 1)[1])
        if not 1 <= n <= len(speeds):
            raise SystemExit(f"--cpus: fastest:N needs 1 <= N <= {len(speeds)}, got {n}")
        return sorted(sorted(speeds, key=lambda c: (speeds[c], c))[:n])
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


    return None
