"""Per-step host-to-device uploads through one persistent pinned arena.

A step copies its small host arrays (ids, positions, slot mapping, page tables, gather
indices) into a pinned host arena and from there, asynchronously, into a device arena (or a
given device buffer) on the compute stream. Nothing is allocated per step, and the host never
waits for the device: ``end_uploads`` records an event right after the step's copies, and the
next step's ``begin_uploads`` waits for that event before overwriting the pinned arena. The
copies sit in stream order after the previous step's kernels, and the engine only launches a
step after reading the step before the previous one, so that wait returns at once.

On CPU ``upload`` returns ``torch.from_numpy(array)`` (sharing the array's memory), exactly as
the engine did before.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


class Staging:
    """Pinned host arena + device arena for one engine's per-step uploads.

    Args:
        device: the engine's device.
        capacity: initial arena size in bytes (grows on demand).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 20):
        self.device = device
        self.cuda = device.type == "cuda"
        self._offset = 0
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        if self.cuda:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        # the old arenas stay alive while copies that read them are queued: the caching
        # allocators only reuse their memory once those copies are done
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self._host is None else self._host.numel()

    def begin_uploads(self) -> None:
        """Starts a step's uploads (waits until the previous step's copies have run)."""
        if self._event is not None:
            self._event.synchronize()
        self._offset = 0

    def end_uploads(self) -> None:
        """Marks the end of this step's uploads on the current stream."""
        if self.cuda:
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """A device copy of ``array`` (into ``out`` when given, else a view of the device
        arena valid until the next step's uploads). Never blocks on the device."""
        array = np.ascontiguousarray(array)
        if not self.cuda:
            tensor = torch.from_numpy(array)
            return tensor if out is None else out.copy_(tensor)
        nbytes = array.nbytes
        start = self._offset
        end = start + nbytes
        if end > self.capacity:
            self._allocate(max(2 * self.capacity, end * 2))
            start, end = 0, nbytes
        self._offset = -(-end // _ALIGN) * _ALIGN
        dtype = torch.from_numpy(array[:0]).dtype
        host = self._host[start:end]
        host.numpy()[:] = array.view(np.uint8).reshape(-1)
        src = host.view(dtype).view(array.shape)
        if out is None:
            out = self._dev[start:end].view(dtype).view(array.shape)
        return out.copy_(src, non_blocking=True)
