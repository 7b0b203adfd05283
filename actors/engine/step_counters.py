"""Running totals of an engine's ``step()`` calls, kept on every step (a few clock reads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepCounters:
    """Running totals of ``Engine.step()`` calls: ``steps`` that launched work, seconds inside
    ``step()`` (``busy_s``) and, of those, seconds blocked on the device for the previous
    step's results (``device_wait_s``), and the CPU time the stepping thread got outside those
    waits (``cpu_s``, ``time.thread_time``). Differences of two snapshots describe a stretch
    of work: host time per step is ``(busy_s - device_wait_s) / steps``; a host that keeps
    ahead of the device shows most of ``busy_s`` as waiting; host time well above ``cpu_s`` is
    time the thread was runnable but not running (another thread holding the GIL, or no free
    core). ``seqs``: the sequences those steps ran, summed (``seqs / steps`` is the mean
    batch: how full the engine was)."""

    steps: int = 0
    busy_s: float = 0.0
    device_wait_s: float = 0.0
    cpu_s: float = 0.0
    seqs: int = 0

    def snapshot(self) -> "StepCounters":
        return StepCounters(self.steps, self.busy_s, self.device_wait_s, self.cpu_s, self.seqs)

    def since(self, before: "StepCounters") -> "StepCounters":
        return StepCounters(self.steps - before.steps, self.busy_s - before.busy_s,
                            self.device_wait_s - before.device_wait_s, self.cpu_s - before.cpu_s,
                            self.seqs - before.seqs)
