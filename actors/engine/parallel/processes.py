"""Ranks 1..tp-1 of a replica as child processes of rank 0 (``python -m
actors.engine.parallel.worker``), the launcher outside Ray: a plain process, a driver,
``toolkit.generate``. Rank r uses GPU r of the visible ones (GPU 0 when there are fewer, then
the ranks share it over gloo); the rendezvous is on 127.0.0.1. The children leave on their own
when rank 0's process dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch

from actors.engine.parallel.comm import choose_backend, free_port, rank_device


class ProcessRanks:
    """Starts ranks 1..tp-1 of ``config`` (an ``EngineConfig``) for ``model``; rank 0 joins them
    at ``host:port`` with ``backend`` on ``device``."""

    def __init__(self, model: str, config: Any):
        tp = config.tensor_parallel_size
        self.host, self.port = "127.0.0.1", free_port()
        self.device = rank_device(config.device, 0)
        on_gpu = config.device.startswith("cuda")
        self.ranks_per_device = tp if on_gpu and torch.cuda.device_count() < tp else 1
        self.backend = choose_backend(config.device, self.ranks_per_device)
        common = dict(world_size=tp, host=self.host, port=self.port, model=model,
                      config=config.to_dict(), backend=self.backend,
                      ranks_per_device=self.ranks_per_device, parent=os.getpid())
        # the children import from where this process does (a Ray worker's path included)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, tp):
            args = json.dumps({**common, "rank": rank})
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "actors.engine.parallel.worker", args], env=env))

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1."""
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        """Raises ``RuntimeError`` when a rank has exited (the replica is broken)."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with "
                                   f"code {code}; the replica cannot continue")

    def all_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def join(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for each rank to end, then kills it."""
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
