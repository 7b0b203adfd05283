"""Rank 0's side of a replica: starts ranks 1..tp-1 as child processes, joins their process
group, and ends them when the engine is closed or dropped (``weakref.finalize``), so no
process is left behind. The children leave on their own when this process dies."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import weakref
from typing import Any

from actors.engine.parallel.comm import (
    OP_SHUTDOWN,
    TPComm,
    choose_backend,
    free_port,
    rank_device,
)

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 30.0


def precheck(model: str, config: Any) -> None:
    """Refuses a tensor-parallel size the model's heads cannot take, before any rank starts
    (``ValueError`` naming ``engine.tensor_parallel_size``)."""
    from transformers import AutoConfig

    from actors.engine.engine_config import check_tensor_parallel

    text = AutoConfig.from_pretrained(model, trust_remote_code=config.trust_remote_code,
                                      revision=config.revision).get_text_config()
    heads = text.num_attention_heads
    check_tensor_parallel(config.tensor_parallel_size, heads,
                          getattr(text, "num_key_value_heads", None) or heads)


class Replica:
    """The worker ranks of one engine and rank 0's communicator.

    Args:
        model: the model path or id (every rank loads it and keeps its shard).
        config: the engine's ``EngineConfig`` (``tensor_parallel_size`` > 1).
    """

    def __init__(self, model: str, config: Any):
        tp = config.tensor_parallel_size
        precheck(model, config)
        port = free_port()
        backend = choose_backend(config.device, tp)
        common = dict(world_size=tp, port=port, model=model, config=config.to_dict(),
                      backend=backend, parent=os.getpid())
        # the children import from where this process does (a Ray worker's path included)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, tp):
            args = json.dumps({**common, "rank": rank})
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "actors.engine.parallel.worker", args], env=env))
        try:
            self.comm = TPComm(0, tp, port, rank_device(config.device, 0), backend)
        except BaseException:
            _end(None, self.procs)
            raise
        self._finalizer = weakref.finalize(self, _end, self.comm, self.procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1."""
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        """Raises ``RuntimeError`` when a worker rank has exited (the replica is broken)."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with "
                                   f"code {code}; the replica cannot continue")

    def close(self) -> None:
        """Stops the worker ranks and leaves the process group (idempotent)."""
        self._finalizer()


def _end(comm: TPComm | None, procs: list[subprocess.Popen]) -> None:
    if comm is not None:
        if all(p.poll() is None for p in procs):
            try:
                comm.send_header(OP_SHUTDOWN)
            except Exception as exc:  # noqa: BLE001 - a rank died meanwhile: killed below
                logger.warning("tensor-parallel shutdown message failed: %s", exc)
    for proc in procs:
        try:
            proc.wait(timeout=_JOIN_TIMEOUT_S if comm is not None else 0.1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if comm is not None:
        comm.close()
