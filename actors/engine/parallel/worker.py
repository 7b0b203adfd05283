"""Ranks 1..tp-1 of a replica: load and shard the model, size the KV pool as rank 0 says,
then run whatever rank 0 broadcasts (steps, sleep / wake, weight updates) until it says stop.

``serve_rank`` is that loop, whoever started the rank: a Ray rank actor
(``rank_actors.RankActor``) or a child process of rank 0 (``worker_main``, which also exits
when rank 0's process dies: its sockets close under the collective it waits in, and a
watchdog sees the parent go).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from actors.engine.parallel.comm import (
    OP_LOGITS,
    OP_SHUTDOWN,
    OP_SIZES,
    OP_SLEEP,
    OP_STEP,
    OP_WAKE,
    OP_WEIGHTS,
    TPComm,
)

logger = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")


def wake_mask(tags: Any) -> int:
    """``wake_up`` tags as a bitmask (0: all)."""
    return 0 if tags is None else sum(1 << WAKE_TAGS.index(t) for t in tags)


def wake_tags(mask: int) -> list[str] | None:
    return None if mask == 0 else [t for i, t in enumerate(WAKE_TAGS) if mask >> i & 1]


class WorkerRank:
    """One non-zero rank: its shard of the model, its KV pool and its model runner."""

    def __init__(self, model: str, config: Any, comm: TPComm):
        from actors.engine.builder import (
            capture_graphs,
            make_kv_cache,
            resolve_cuda_graphs,
            probe_attention_layers,
            resolve_fused_layers,
            resolve_fused_projections,
        )
        from actors.engine.model.attention import get_attention_backend, resolve_backend_name
        from actors.engine.model.attention.torch_backend import TorchAttentionBackend
        from actors.engine.model.model_runner import ModelRunner
        from actors.engine.parallel.sharding import load_shard
        from actors.engine.sleep import SleepController
        from actors.engine.weights import WeightLoader

        self.comm = comm
        loaded, slices = load_shard(model, config, comm)
        device = loaded.device
        if resolve_fused_projections(config, device):
            from actors.engine.model.fused_projections import install_fused_projections

            install_fused_projections(loaded.model)
        fused = None
        if resolve_fused_layers(config, device):
            from actors.engine.model.fused_layers import install_fused_layers

            fused = install_fused_layers(loaded.model)
        header = comm.recv_header()
        self.stopped = header[0] == OP_SHUTDOWN  # rank 0 failed to build its part
        if self.stopped:
            return
        assert header[0] == OP_SIZES, f"expected the pool sizes, got op {header[0]}"
        num_blocks, max_model_len = header[1], header[2]
        name = resolve_backend_name(config.attention_backend, device, loaded.dtype,
                                    loaded.head_dim, value_dim=loaded.value_dim,
                                    layer_specs=loaded.layer_specs)
        use_graphs = resolve_cuda_graphs(config, device, name)  # as rank 0 decides
        kv_cache = make_kv_cache(loaded, num_blocks, config.block_size, device,
                                 num_scratch_blocks=1 if use_graphs else 0)
        reference = TorchAttentionBackend(kv_cache, loaded.num_heads, loaded.num_kv_heads,
                                          loaded.head_dim)
        runner = ModelRunner(loaded, kv_cache, reference, max_num_seqs=config.max_num_seqs,
                             max_model_len=max_model_len, fused=fused)
        runner.comm = comm  # its decode graphs capture around this rank's collectives
        with comm.local():
            layer_specs = probe_attention_layers(runner)
        if name != "torch":
            runner.set_backend(get_attention_backend(
                name, kv_cache, num_heads=loaded.num_heads, num_kv_heads=loaded.num_kv_heads,
                head_dim=loaded.head_dim, layer_specs=layer_specs,
                max_model_len=max_model_len))
        if use_graphs:
            runner.graphs = capture_graphs(runner, config, kv_cache, max_model_len)
        self.runner = runner
        self.weights = WeightLoader(loaded.model, slices)
        self.memory = SleepController(kv_cache, self.weights, runner)

    @torch.no_grad()
    def serve(self) -> None:
        """Runs rank 0's messages until ``OP_SHUTDOWN``."""
        from actors.engine.parallel.step import run_worker_logits, run_worker_step

        comm = self.comm
        while not self.stopped:
            header = comm.recv_header()
            op = header[0]
            if op == OP_STEP:
                run_worker_step(self.runner, comm, header)
            elif op == OP_LOGITS:
                run_worker_logits(self.runner, comm, header)
            elif op == OP_SLEEP:
                self.memory.sleep(header[1])
            elif op == OP_WAKE:
                self.memory.wake_up(wake_tags(header[1]))
            elif op == OP_WEIGHTS:
                self.weights.load(recv_weights(comm))
            elif op == OP_SHUTDOWN:
                return
            else:
                raise RuntimeError(f"tensor-parallel rank {comm.rank}: unknown op {op}")


def send_weights(comm: TPComm, items: list[tuple[str, torch.Tensor]]) -> None:
    """Rank 0: broadcasts full (unsharded) tensors; every rank keeps its slice."""
    comm.send_header(OP_WEIGHTS, len(items))
    comm.broadcast_object([(name, tuple(t.shape), str(t.dtype).replace("torch.", ""))
                           for name, t in items])
    for _, tensor in items:
        comm.broadcast(tensor.detach().to(comm.device).contiguous())


def recv_weights(comm: TPComm) -> list[tuple[str, torch.Tensor]]:
    specs = comm.broadcast_object()
    out = []
    for name, shape, dtype in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=comm.device)
        out.append((name, comm.broadcast(tensor)))
    return out


def _watch_parent(parent: int) -> None:
    """Ends this process once its parent (rank 0) is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve_rank(rank: int, world_size: int, host: str, port: int, model: str, config: dict,
               backend: str, ranks_per_device: int) -> None:
    """Rank ``rank`` of a replica: joins its process group at ``host:port`` (rank 0 hosts it),
    loads its shard on ``config["device"]`` and serves rank 0 until told to stop."""
    from actors.engine.cpu_threads import CPUThreads
    from actors.engine.engine_config import EngineConfig

    config = EngineConfig.from_dict(config)
    if config.cpu_threads is not None:  # rank 0's count (actors.engine.cpu_threads)
        CPUThreads(config.cpu_threads).enter()
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    comm = TPComm(rank, world_size, host, port, config.device, backend, ranks_per_device)
    try:
        WorkerRank(model, config, comm).serve()
    finally:
        comm.close()


def worker_main(rank: int, world_size: int, host: str, port: int, model: str, config: dict,
                backend: str, ranks_per_device: int, parent: int) -> None:
    """A worker process: rank ``rank`` on GPU ``rank`` of the visible ones (or CPU), ended
    when its parent is."""
    from actors.engine.parallel.comm import rank_device

    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    config = {**config, "device": rank_device(config["device"], rank)}
    serve_rank(rank, world_size, host, port, model, config, backend, ranks_per_device)


if __name__ == "__main__":  # python -m actors.engine.parallel.worker '<json arguments>'
    import json
    import sys

    logging.basicConfig(level=logging.WARNING)
    worker_main(**json.loads(sys.argv[1]))
