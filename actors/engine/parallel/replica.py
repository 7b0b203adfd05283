"""Rank 0's side of a replica: starts ranks 1..tp-1, joins their process group, and ends them
when the engine is closed or dropped (``weakref.finalize``), so no rank is left behind.

Who starts the other ranks is chosen here, once: inside a Ray actor that runs in a placement
group with a bundle per rank, Ray actors in those bundles (``rank_actors``); anywhere else,
child processes (``processes``). Both run the same loop (``worker.serve_rank``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from actors.engine.parallel.comm import OP_SHUTDOWN, OP_SLEEP, OP_WAKE, TPComm
from actors.engine.parallel.processes import ProcessRanks
from actors.engine.parallel.rank_actors import ActorRanks, current_group
from actors.engine.parallel.worker import send_weights, wake_mask

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


def start_ranks(model: str, config: Any) -> Any:
    """Ranks 1..tp-1 started the way this process allows: ``ActorRanks`` or
    ``ProcessRanks``."""
    group = current_group(config.tensor_parallel_size)
    if group is not None:
        return ActorRanks(model, config, group)
    return ProcessRanks(model, config)


class Replica:
    """The other ranks of one engine (``ranks``) and rank 0's communicator (``comm``).

    Args:
        model: the model path or id (every rank loads it and keeps its shard).
        config: the engine's ``EngineConfig`` (``tensor_parallel_size`` > 1).
    """

    def __init__(self, model: str, config: Any):
        precheck(model, config)
        self.ranks = start_ranks(model, config)
        ranks = self.ranks
        try:
            self.comm = TPComm(0, config.tensor_parallel_size, ranks.host, ranks.port,
                               ranks.device, ranks.backend, ranks.ranks_per_device)
        except BaseException:
            _end(None, ranks)
            raise
        self._finalizer = weakref.finalize(self, _end, self.comm, ranks)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1."""
        return list(self.ranks.pids)

    def check_alive(self) -> None:
        """Raises ``RuntimeError`` when another rank has ended (the replica is broken)."""
        self.ranks.check_alive()

    def send_weights(self, items: list[tuple[str, Any]]) -> None:
        """Sends full (unsharded) ``(name, tensor)`` pairs; every rank loads its slice."""
        send_weights(self.comm, items)

    def sleep(self, level: int) -> None:
        """Tells the other ranks to free their KV cache (level 1) and weights (level 2)."""
        self.comm.send_header(OP_SLEEP, level)

    def wake_up(self, tags: Any) -> None:
        """Tells the other ranks to re-allocate what ``sleep`` freed (``tags``: as in
        ``Engine.wake_up``)."""
        self.comm.send_header(OP_WAKE, wake_mask(tags))

    def close(self) -> None:
        """Stops the other ranks and leaves the process group (idempotent)."""
        self._finalizer()


def _end(comm: TPComm | None, ranks: Any) -> None:
    if comm is not None and ranks.all_alive():
        try:
            comm.send_header(OP_SHUTDOWN)
        except Exception as exc:  # noqa: BLE001 - a rank died meanwhile: ended below
            logger.warning("tensor-parallel shutdown message failed: %s", exc)
    ranks.join(_JOIN_TIMEOUT_S if comm is not None else 0.1)
    if comm is not None:
        comm.close()
