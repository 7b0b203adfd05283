"""Per-step timing of the engine on CUDA: device events around each launched step.

Benchmarks attach a ``StepTimer`` to an engine (``timer.attach(engine)``, ``timer.detach()``):
it wraps the executor's ``launch_model``, ``forward`` and ``sample`` to mark their phases,
so an engine without a timer runs no timing check. For each step it records host clocks and three events on the compute stream: before the
step's first device operation (its uploads), before the sampler, and after the sampler. The
device is idle between two steps from the end event of one to the start event of the next:
that start event only runs once the host has enqueued it, so the gap is the time the device
waited for the host (bubbles inside a step, e.g. an eager forward that launches slower than the
device runs, are not counted here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class _Step:
    num_tokens: int
    num_seqs: int
    host_start: float
    host_end: float = 0.0
    events: dict[str, torch.cuda.Event] = field(default_factory=dict)
    host_marks: dict[str, float] = field(default_factory=dict)  # host clock at each mark
    wait_s: float = 0.0  # host time blocked on sampled tokens after this step's launch


class StepTimer:
    """Collects step timings; ``summary()`` reads them (it synchronises the device)."""

    def __init__(self) -> None:
        self.steps: list[_Step] = []
        self.wait_s = 0.0          # host time spent waiting for sampled tokens
        self._clock_start = time.perf_counter()
        self._engine: Any = None
        self._waited = 0.0         # the engine's device_wait_s at the last step's launch

    def attach(self, engine: Any) -> "StepTimer":
        """Times every step ``engine`` launches from now on, until :meth:`detach`."""
        executor = engine.executor
        self._engine, self._waited = engine, engine.counters.device_wait_s

        launch_model, forward, sample = executor.launch_model, executor.forward, executor.sample

        def timed_launch_model(sched: Any, prev: Any) -> Any:
            self._count_wait()
            self.begin_step(sched.num_tokens, len(sched.seqs))
            step, inputs, logits = launch_model(sched, prev)
            if logits is None:  # no row samples: the step ends with its forward
                self.end_step()
            return step, inputs, logits

        def timed_forward(*args: Any) -> Any:  # after the inputs' preparation
            self.mark("gpu_start")
            return forward(*args)

        def timed_sample(*args: Any) -> None:
            self.mark("sample")
            sample(*args)
            self.end_step()

        executor.launch_model, executor.forward, executor.sample = (
            timed_launch_model, timed_forward, timed_sample)
        return self

    def detach(self) -> None:
        """Puts the executor's own methods back and counts the last step's wait."""
        if self._engine is not None:
            self._count_wait()
            executor = self._engine.executor
            del executor.launch_model, executor.forward, executor.sample
            self._engine = None

    def _count_wait(self) -> None:
        """The engine's wait for sampled tokens since the last launch goes to the step
        launched last (the engine launches step N + 1 before it reads step N back)."""
        total = self._engine.counters.device_wait_s
        waited = max(0.0, total - self._waited)  # counters replaced by a fresh set: none
        self._waited = total
        self.wait_s += waited
        if self.steps:
            self.steps[-1].wait_s += waited

    def begin_step(self, num_tokens: int, num_seqs: int) -> None:
        self.steps.append(_Step(num_tokens, num_seqs, time.perf_counter()))

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.steps[-1].events[name] = event
        self.steps[-1].host_marks[name] = time.perf_counter()

    def end_step(self) -> None:
        self.mark("end")
        self.steps[-1].host_end = time.perf_counter()

    def summary(self, min_batch: int = 0) -> dict[str, Any]:
        """Decode-step figures over the pure-decode steps with at least ``min_batch`` rows:
        ``decode_steps``, ``ms_per_decode_step`` (start-to-start period), ``gpu_ms_per_step``
        (start to end), ``sampler_ms_per_step``, ``idle_fraction`` (gaps over the period),
        ``host_launch_ms`` (host time inside ``launch``), ``host_phase_ms`` (where the host's
        time a step goes: :func:`host_phases`), ``largest_gaps`` (see
        :func:`largest_gaps`), and over the whole timed run ``host_busy_fraction`` (host time
        not spent waiting for sampled tokens)."""
        torch.cuda.synchronize()
        steps = [s for s in self.steps if "gpu_start" in s.events and "end" in s.events]
        pick = [i for i in range(len(steps) - 1)
                if steps[i].num_tokens == steps[i].num_seqs >= max(1, min_batch)]
        if not pick:
            return {"decode_steps": 0}
        period, busy, gap, sample, host = [], [], [], [], []
        for i in pick:
            s, nxt = steps[i], steps[i + 1]
            start, end = s.events["gpu_start"], s.events["end"]
            period.append(start.elapsed_time(nxt.events["gpu_start"]))
            busy.append(start.elapsed_time(end))
            gap.append(end.elapsed_time(nxt.events["gpu_start"]))
            if "sample" in s.events:
                sample.append(s.events["sample"].elapsed_time(end))
            host.append((s.host_end - s.host_start) * 1e3)
        total = float(np.sum(period))
        gaps = largest_gaps(steps, [(i, g) for i, g in zip(pick, gap)])
        return {
            "decode_steps": len(pick),
            "mean_batch": float(np.mean([steps[i].num_seqs for i in pick])),
            "ms_per_decode_step": float(np.median(period)),
            "gpu_ms_per_step": float(np.median(busy)),
            "sampler_ms_per_step": float(np.median(sample)) if sample else 0.0,
            "idle_fraction": float(np.sum(gap)) / total if total > 0 else 0.0,
            "host_launch_ms": float(np.median(host)),
            "host_phase_ms": host_phases(steps, pick),
            "largest_gaps": gaps,
            "host_busy_fraction": 1.0 - self.wait_s / max(
                1e-9, self.steps[-1].host_end - self._clock_start),
        }


def host_phases(steps: list[_Step], pick: list[int]) -> dict[str, float]:
    """Median host milliseconds a step over ``pick`` (indices of steps that have a successor):
    ``prepare`` (launch start to the first device operation), ``forward`` (to the sampler:
    the model's launch and the LM head), ``sampler`` (to the launch's end: the sampler's
    launch and the copies it starts), ``outside_launch`` (from the end of the launch to the
    next one's start, less the wait for sampled tokens: the previous step's outputs and the
    next schedule)."""
    phases: dict[str, list[float]] = {"prepare": [], "forward": [], "sampler": [],
                                      "outside_launch": []}
    for i in pick:
        s, nxt = steps[i], steps[i + 1]
        marks = s.host_marks
        if "sample" in marks:
            phases["prepare"].append(marks["gpu_start"] - s.host_start)
            phases["forward"].append(marks["sample"] - marks["gpu_start"])
            phases["sampler"].append(s.host_end - marks["sample"])
        phases["outside_launch"].append(nxt.host_start - s.host_end - s.wait_s)
    return {k: float(np.median(v)) * 1e3 for k, v in phases.items() if v}


def largest_gaps(steps: list[_Step], gaps: list[tuple[int, float]],
                 count: int = 5) -> list[dict[str, float]]:
    """The ``count`` largest device-idle gaps, ``(index of the step before the gap, gap ms)``,
    with where the host's time went between that step's launch and the next one's first
    device operation: ``waited_ms`` (blocked on the previous step's sampled tokens),
    ``host_between_ms`` (from the end of the launch to the next step's start: that wait, the
    outputs of the previous step, the next schedule) and ``prepare_ms`` (the next step's input
    packing, up to its first device operation)."""
    out = []
    for i, gap in sorted(gaps, key=lambda g: -g[1])[:count]:
        s, nxt = steps[i], steps[i + 1]
        out.append({
            "step": i, "num_seqs": nxt.num_seqs, "gap_ms": float(gap),
            "waited_ms": s.wait_s * 1e3,
            "host_between_ms": (nxt.host_start - s.host_end) * 1e3,
            "prepare_ms": (nxt.host_marks.get("gpu_start", nxt.host_start) - nxt.host_start) * 1e3,
        })
    return out
