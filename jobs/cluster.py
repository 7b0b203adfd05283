"""Connecting the driver to Ray, and creating generation actors on it."""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

IN_FLIGHT_PER_ACTOR = 2  # shards per actor at once: the next one queues while one finishes
# the most shards an actor holds when small shards share its engine (jobs.dispatch)
MAX_SHARDS_IN_FLIGHT = 32


def connect(address: str | None) -> None:
    """Connects to Ray: an already connected session, else ``address``, else ``RAY_ADDRESS``,
    else a new local Ray that listens on 127.0.0.1 only (kept for later jobs of the process).
    ``address="local"`` always starts that local Ray."""
    # Read by Ray at import time: a local Ray then binds loopback instead of the host's address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        # worker lines forwarded to a file or a pipe: no colour codes around their prefix
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    started = time.perf_counter()
    if target and target != "local":
        logger.info("connecting to Ray at %s", target)
        ray.init(address=target, logging_level=logging.WARNING)
    else:
        logger.info("starting a local Ray on 127.0.0.1")
        # Ray turns token auth on for a new local cluster and warns that it did: that note
        # is about the cluster raygen starts here, nothing for the user to do
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            _TokenAuthNote())
        # no idle workers started for the driver (Ray starts one per CPU by default, which on
        # a many-core node compete with the actors' own start); actors start their own
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                 _system_config={"prestart_worker_first_driver": False})
        atexit.register(_stop_monitor)  # runs before Ray's exit hook, registered earlier
    logger.info("Ray ready in %.1f s", time.perf_counter() - started)


def disconnect() -> None:
    """Ends this process's Ray session (``ray.shutdown``): a local Ray it started stops
    (its monitor first, :func:`_stop_monitor`), a cluster is only left."""
    import ray

    _stop_monitor()
    ray.shutdown()


def _stop_monitor() -> None:
    """Kills the autoscaler monitor of the local Ray this process started, if it runs
    (nothing to keep on one node): Ray's shutdown stops it after the GCS, and with the GCS
    gone it does not end on SIGTERM, so the shutdown would wait a second for it before
    killing it anyway. Also run at the interpreter's exit, before Ray's own exit hook."""
    ray = sys.modules.get("ray")
    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    if node is None or not getattr(node, "head", False):
        return
    for info in getattr(node, "all_processes", {}).get("monitor", []):
        process = info.process
        if process.poll() is None:
            process.kill()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # left to the shutdown, as before
                pass


def replica_bundles(engine_options: Any, num_gpus_per_actor: float,
                    num_cpus: float = 1) -> list[dict[str, float]] | None:
    """The placement-group bundles of a replica (a job's or a ``RolloutPool``'s): one per
    tensor-parallel rank, each ``num_cpus`` CPUs and ``num_gpus_per_actor`` GPUs (rank 0, the
    generation actor, in bundle 0; it starts the other ranks in theirs,
    ``actors.engine.parallel.rank_actors``). None for one rank: the actor alone, no group."""
    tp = _tensor_parallel_size(engine_options)
    if tp == 1:
        return None
    bundle = {"CPU": float(num_cpus)}
    if num_gpus_per_actor > 0:
        bundle["GPU"] = float(num_gpus_per_actor)
    return [dict(bundle) for _ in range(tp)]


def replica_group(bundles: list[dict[str, float]]) -> Any:
    """A placement group for one replica: its bundles packed on one node (STRICT_PACK)."""
    from ray.util.placement_group import placement_group

    return placement_group(bundles, strategy="STRICT_PACK")


def in_bundle_zero(group: Any) -> Any:
    """The scheduling strategy that starts a replica's rank 0 in bundle 0 of ``group``; None
    (Ray's default placement) without a group."""
    if group is None:
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)


def remove_replica_group(group: Any) -> None:
    """Removes a replica's placement group, which ends every actor in it."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def _tensor_parallel_size(engine_options: Any) -> int:
    if hasattr(engine_options, "tensor_parallel_size"):  # an EngineConfig
        return int(engine_options.tensor_parallel_size)
    return int(dict(engine_options or {}).get("tensor_parallel_size", 1))


class _TokenAuthNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this")


def check_resources(num_actors: int, num_gpus: float, num_cpus: float = 1) -> None:
    """Fails early when the cluster cannot hold the pool at all: ``num_actors`` replicas of
    ``num_gpus`` GPUs and ``num_cpus`` CPUs each, every replica on one node."""
    import ray

    resources = ray.cluster_resources()
    if num_gpus > 0:
        have = resources.get("GPU", 0)
        if num_actors * num_gpus > have:
            raise ValueError(
                f"config.num_actors: {num_actors} actors x {num_gpus:g} GPUs (num_gpus_per_actor "
                f"per tensor-parallel rank) need {num_actors * num_gpus:g} GPUs, the Ray cluster "
                f"has {have:g} (set num_gpus_per_actor: 0 to run on CPU)")
    have = resources.get("CPU", 0)
    if num_actors * num_cpus > have:
        raise ValueError(f"config.num_actors: {num_actors} actors x {num_cpus:g} CPUs need "
                         f"{num_actors * num_cpus:g} CPUs, the Ray cluster has {have:g}")
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if nodes and not any(n.get("GPU", 0) >= num_gpus and n.get("CPU", 0) >= num_cpus
                         for n in nodes):
        raise ValueError(f"config.num_gpus_per_actor: a replica needs {num_gpus:g} GPUs and "
                         f"{num_cpus:g} CPUs on one node (its tensor-parallel ranks share a "
                         "node); no node of the Ray cluster has as many")


def actor_factory(actor_cls: Any, model: str, engine_config: Any, num_gpus: float,
                  shards_at_once: int = IN_FLIGHT_PER_ACTOR):
    """A function that starts one generation actor and returns its handle:
    ``start(first_shard=None, placement_group=None)`` constructs ``actor_cls(model,
    engine_config, first_shard=first_shard)`` (``GenerationActor`` reads that shard while its
    model loads), in bundle 0 of ``placement_group`` when given (a tensor-parallel replica).
    ``num_gpus``: the actor's GPUs (a replica's rank 0: GPUs per rank). ``shards_at_once``: the
    most ``process_shard`` calls the dispatcher has on one actor (each runs on a thread of its
    own; one more thread answers the startup report)."""
    import ray

    remote_cls = ray.remote(actor_cls)
    options = dict(num_cpus=1, num_gpus=num_gpus, max_concurrency=shards_at_once + 1,
                   max_restarts=0, max_task_retries=0)

    def start(first_shard: Any = None, placement_group: Any = None) -> Any:
        return remote_cls.options(**options,
                                  scheduling_strategy=in_bundle_zero(placement_group)).remote(
            model, engine_config, first_shard=first_shard)

    return start


def wait_until_dead(handles: list[Any], timeout: float = 10.0) -> None:
    """Waits until the killed actors are gone. ``ray.kill`` only sends the kill; a driver that
    returned at once and then shut its local Ray down would leave actors still alive to be
    stopped by SIGTERM, a normal interpreter exit in which Triton's nanobind bindings report
    whatever compiled-kernel state is still alive as leaks (a ~40-line dump). A killed actor
    ends without running its interpreter's finalizers."""
    import ray

    deadline = time.monotonic() + timeout
    for handle in handles:
        while time.monotonic() < deadline:
            try:
                ray.get(handle.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(),
                                                                   0.1))
            except ray.exceptions.GetTimeoutError:
                break
            except Exception:  # noqa: BLE001 - ActorDiedError and its kin: it is gone
                break
            time.sleep(0.05)  # answered: the kill has not landed yet
