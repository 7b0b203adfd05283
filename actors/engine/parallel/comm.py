"""The collectives of a tensor-parallel replica, over ``torch.distributed``.

A private process group per replica over a TCP store that rank 0 hosts (not the default group,
so one process can hold several tensor-parallel engines): NCCL when every rank has a GPU of
its own, gloo otherwise (CPU, or several ranks sharing one GPU: NCCL refuses two ranks on a
device). Who starts the other ranks, and so the address, backend and GPU sharing every rank is
given, is the launcher's business (``processes``, ``rank_actors``).
Rank 0 drives: every message starts with a fixed ``[HEADER]`` int64 tensor (an op code and its
integers), broadcast from rank 0, followed by that op's tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import socket
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

HEADER = 8
OP_STEP, OP_SLEEP, OP_WAKE, OP_WEIGHTS, OP_SHUTDOWN, OP_SIZES, OP_LOGITS = 1, 2, 3, 4, 5, 6, 7
# a worker waits for rank 0's next message for as long as the engine is idle (between RL
# rounds, say); a dead peer is seen at once (its sockets close), not by this timeout
_TIMEOUT = datetime.timedelta(days=7)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous of the replica's ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: CPU, or GPU ``rank`` when there are that many, else GPU 0."""
    if not device.startswith("cuda"):
        return device
    count = torch.cuda.device_count()
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}" if base + rank < count else f"cuda:{base}"


def choose_backend(device: str, ranks_per_device: int) -> str:
    """NCCL when the ranks have a GPU each (``ranks_per_device`` 1), gloo otherwise."""
    if device.startswith("cuda") and ranks_per_device == 1 \
            and hasattr(torch.distributed, "ProcessGroupNCCL"):
        return "nccl"
    return "gloo"


class TPComm:
    """One rank's view of the replica's process group.

    Args:
        rank, world_size: this rank and the replica size.
        host, port: the TCP rendezvous, hosted by rank 0.
        device: this rank's device ("cpu" or "cuda:<i>"); tensors of the collectives live
            there (gloo moves CUDA tensors through the host).
        backend: "nccl" or "gloo" (``choose_backend``).
        ranks_per_device: how many of the replica's ranks share this rank's GPU (1 on CPU);
            each sizes its KV pool from its share of the device.
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, device: str,
                 backend: str, ranks_per_device: int = 1):
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.backend = backend
        self.enabled = True  # False while a rank runs a local-only forward (probes)
        self.capturing = False  # a decode CUDA graph is being captured (no messages)
        self._split = None  # gloo capture: ends the graph piece before an all-reduce
        self.ranks_per_device = ranks_per_device if self.device.type == "cuda" else 1
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._store = dist.TCPStore(host, port, world_size, rank == 0,
                                    timeout=_TIMEOUT, wait_for_workers=True)
        group_cls = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
        self.group = group_cls(self._store, rank, world_size, _TIMEOUT)
        logger.info("tensor-parallel rank %d/%d up (%s on %s)", rank, world_size, backend,
                    device)

    # ------------------------------------------------------------------ forward
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place (a no-op while disabled; while a gloo
        capture runs, the graph piece ends here and the sum runs between replays)."""
        if self._split is not None:
            self._split(tensor)
        elif self.enabled:
            self.group.allreduce([tensor]).wait()
        return tensor

    @property
    def graph_all_reduce(self) -> bool:
        """Whether an all-reduce can be captured inside a CUDA graph (NCCL); gloo's runs on
        the host, so a decode graph over gloo is captured in pieces between all-reduces."""
        return self.backend == "nccl"

    @contextlib.contextmanager
    def capture(self, split=None) -> Iterator[None]:
        """Forwards inside are captured into a CUDA graph: rank 0 sends no step, and each
        all-reduce is captured (NCCL) or calls ``split(tensor)`` (gloo: the capture's piece
        ends there, and the replay sums ``tensor`` before the next piece)."""
        self.capturing, self._split = True, split
        try:
            yield
        finally:
            self.capturing, self._split = False, None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([parts], [tensor]).wait()
        return parts

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Forwards inside run on this rank alone (their all-reduces are skipped): the
        load-time probes, which every rank runs by itself."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    # ------------------------------------------------------------------ messages
    def send_header(self, op: int, *values: int) -> None:
        """Rank 0: starts a message."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = op
        header[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        self.broadcast(header.to(self.device))

    def recv_header(self) -> list[int]:
        """Ranks > 0: waits for rank 0's next message."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        self.broadcast(header)
        return header.tolist()

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` to every rank (in place)."""
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def broadcast_object(self, value: Any = None) -> Any:
        """A small picklable object from rank 0 (control messages only, never per step)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            data = pickle.dumps(value)
            size[0] = len(data)
        self.broadcast(size)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buf)
        return value if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())

    def close(self) -> None:
        """Leaves the group (its connections close; a peer still waiting sees them go)."""
        self.group = None
        self._store = None
