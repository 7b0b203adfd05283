"""Ranks 1..tp-1 of a replica as Ray actors, the launcher inside Ray.

Rank 0 (the engine's actor) runs in bundle 0 of a placement group with a bundle per rank (a
job's or a ``RolloutPool``'s replica: STRICT_PACK, so one node, see
``jobs.cluster.replica_bundles``) and starts ``RankActor`` r in bundle r, with that bundle's
CPUs and GPUs: each rank uses the GPU Ray gave it. The rendezvous is on rank 0's node address
(as Ray sees it). The rank actors are owned by rank 0's process, so they end with it; removing
the placement group ends every rank.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from typing import Any

from actors.engine.parallel.comm import choose_backend, free_port
from actors.engine.parallel.worker import serve_rank

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # the rank actors' processes start (their bundles are reserved)
# asking Ray costs ~0.1 ms; Ray itself takes longer than this to see a death
_CHECK_EVERY_S = 0.01


def current_group(world_size: int) -> Any | None:
    """The placement group this process runs in when it is a Ray actor in a group of at least
    ``world_size`` bundles (rank r in bundle r), else None."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        if ray.get_runtime_context().get_actor_id() is None:
            return None
    except Exception:  # noqa: BLE001 - an older or partial Ray: not an actor we can tell
        return None
    group = ray.util.get_current_placement_group()
    if group is None or len(group.bundle_specs) < world_size:
        return None
    return group


class RankActor:
    """One rank > 0 of a replica (``ray.remote``-wrapped by ``ActorRanks``)."""

    def describe(self) -> dict[str, Any]:
        """This rank's process id, the GPU ids Ray gave it and its placement group's id."""
        import ray

        group = ray.util.get_current_placement_group()
        return {"pid": os.getpid(), "gpus": sorted(str(g) for g in ray.get_gpu_ids()),
                "placement_group": group.id.hex() if group is not None else None}

    def serve(self, rank: int, world_size: int, host: str, port: int, model: str,
              config: dict, backend: str, ranks_per_device: int) -> None:
        """``worker.serve_rank``: returns when rank 0 says stop."""
        serve_rank(rank, world_size, host, port, model, config, backend, ranks_per_device)


class ActorRanks:
    """Starts ranks 1..tp-1 of ``config`` (an ``EngineConfig``) for ``model`` in bundles
    1..tp-1 of ``group``; rank 0 joins them at ``host:port`` with ``backend`` on ``device``."""

    def __init__(self, model: str, config: Any, group: Any):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp = config.tensor_parallel_size
        specs = group.bundle_specs
        remote = ray.remote(RankActor)
        self.actors = [remote.options(
            num_cpus=specs[rank].get("CPU", 0), num_gpus=specs[rank].get("GPU", 0),
            max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)).remote() for rank in range(1, tp)]
        self._serving: list[Any] = []
        self._checked = 0.0
        try:
            facts = ray.get([a.describe.remote() for a in self.actors], timeout=_START_TIMEOUT_S)
        except BaseException:
            self.join(0.0)
            raise
        self.pids = [f["pid"] for f in facts]
        self.placement_groups = [f["placement_group"] for f in facts]  # ids, for checks
        gpus = [tuple(sorted(str(g) for g in ray.get_gpu_ids()))] + [tuple(f["gpus"])
                                                                      for f in facts]
        self.device = config.device
        on_gpu = config.device.startswith("cuda")
        # ranks given the same GPU (fractional GPUs, or none: the visible one) share it
        self.ranks_per_device = max(Counter(gpus).values()) if on_gpu else 1
        self.backend = choose_backend(config.device,
                                      self.ranks_per_device if all(gpus) else tp)
        self.host = ray.util.get_node_ip_address()
        self.port = free_port(self.host)
        options = config.to_dict()
        self._serving = [a.serve.remote(rank, tp, self.host, self.port, model, options,
                                        self.backend, self.ranks_per_device)
                         for rank, a in enumerate(self.actors, start=1)]

    def _ended(self) -> list[int]:
        import ray

        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=0,
                           fetch_local=False)
        return [self._serving.index(ref) for ref in done]

    def check_alive(self) -> None:
        """Raises ``RuntimeError`` when a rank actor has died or its loop ended (the replica is
        broken). Asks Ray at most every ``_CHECK_EVERY_S``."""
        import ray

        now = time.monotonic()
        if now - self._checked < _CHECK_EVERY_S:
            return
        self._checked = now
        for i in self._ended():
            try:
                ray.get(self._serving[i])
                reason = "its loop returned"
            except Exception as exc:  # noqa: BLE001 - its death, reported as the replica's
                lines = str(exc).strip().splitlines()
                reason = f"{type(exc).__name__}: {lines[0] if lines else ''}"
            raise RuntimeError(f"tensor-parallel rank {i + 1} (pid {self.pids[i]}) ended "
                               f"({reason}); the replica cannot continue")

    def all_alive(self) -> bool:
        return not self._ended()

    def join(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the ranks' loops to end, then ends the actors."""
        import ray

        try:
            if self._serving and timeout > 0:
                ray.wait(self._serving, num_returns=len(self._serving), timeout=timeout,
                         fetch_local=False)
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - Ray shut down (at exit): the actors with it
            logger.debug("tensor-parallel rank actors not ended here: %s", exc)
