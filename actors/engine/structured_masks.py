"""The host and device buffers of the steps' grammar masks (:mod:`actors.engine.structured`).

On CUDA two pairs (pinned host, device) are taken in turn: a host buffer is reused once its
previous upload has finished, a device buffer once the sampler that read it has (uploads run
on a copy stream of their own, from any thread, and wait for that sampler). On the CPU one
host buffer. A step may need a row for each of the previous step's rows (filled ahead) and
each of its new ones, so a buffer has twice the rows of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Masks:
    """A pinned host buffer of masks and its device buffer (None on the CPU), with the events
    of the host buffer's latest copy and of the device buffer's latest reader."""

    host: torch.Tensor
    dev: torch.Tensor | None
    copied: Any
    used: Any


class MaskBuffers:
    """The mask buffers of one engine: ``[2 * max_num_seqs, words]`` int32 each."""

    def __init__(self, device: torch.device, max_num_seqs: int, words: int) -> None:
        self.device = device
        self.shape = (2 * max_num_seqs, words)
        self._buffers: list[Masks] = []
        self._copy_stream: Any = None
        self._reading: Masks | None = None  # the device masks a queued sampler is to read
        self._turn = 0

    def take(self) -> Masks:
        """The next buffers in turn, once their host buffer's last upload has finished (made
        on first use)."""
        if not self._buffers:
            cuda = self.device.type == "cuda"
            if cuda:
                self._copy_stream = torch.cuda.Stream(self.device)
            for _ in range(2 if cuda else 1):
                host = torch.zeros(self.shape, dtype=torch.int32, pin_memory=cuda)
                dev = (torch.zeros(self.shape, dtype=torch.int32, device=self.device)
                       if cuda else None)
                events = (torch.cuda.Event(), torch.cuda.Event()) if cuda else (None, None)
                self._buffers.append(Masks(host, dev, *events))
        self._turn = (self._turn + 1) % len(self._buffers)
        masks = self._buffers[self._turn]
        if masks.copied is not None:
            masks.copied.synchronize()
        return masks

    def upload(self, masks: Masks, lo: int, hi: int) -> None:
        """Rows ``lo``-``hi`` of the pinned buffer copied to the device buffer on the copy
        stream (from any thread), after the sampler that last read the device buffer; the
        ``copied`` event marks the end of the latest copy."""
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            stream.wait_event(masks.used)
            masks.dev[lo:hi].copy_(masks.host[lo:hi], non_blocking=True)
            masks.copied.record(stream)

    def hand_over(self, masks: Masks, rows: int) -> torch.Tensor:
        """The first ``rows`` masks for the sampler about to be queued on the current stream:
        on CUDA the device rows (the stream waits for their uploads; the buffer's next upload
        waits for that sampler, see :meth:`mark_read`), on the CPU a copy of the host rows."""
        if masks.dev is None:
            return masks.host[:rows].clone()
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self._reading = masks
        return masks.dev[:rows]

    def mark_read(self) -> None:
        """Records, on the current stream, that the sampler given the last handed-over masks
        has been queued (called after its launch)."""
        if self._reading is not None:
            self._reading.used.record(torch.cuda.current_stream(self.device))
            self._reading = None
