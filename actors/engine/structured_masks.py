"""The host and device buffers of the steps' grammar masks (:mod:`actors.engine.structured`).

On CUDA two pairs (pinned host, device) are taken in turn: a host buffer is reused once its
previous upload has finished, a device buffer once the sampler that read it has (uploads run
on a copy stream of their own and wait for that sampler). On the CPU one host buffer. A step
may need a row for each of the previous step's rows (filled ahead) and each of its new ones,
so a buffer has twice the rows of a step.

An upload may be queued before its host rows are filled: the copy stream then first waits,
on the device, until a pinned counter reaches the fill's number (the driver's
``cuStreamWaitValue32``), which the filling thread sets once its rows are written
(:meth:`MaskBuffers.filled`). So the sampler that reads the masks is launched while they
fill, and starts on the device as soon as they are written, with no host thread woken in
between. On the CPU the hand-over of such masks waits for the fill's number on the host.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

# queues the masks' uploads before their fill ends (see the module's docstring); False: the
# host waits for the fill, then queues the upload
DEVICE_WAIT = True


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
        self._filled: torch.Tensor | None = None  # pinned: the number of the latest fill done
        self._wait_value: Callable | None = None  # cuStreamWaitValue32, where it exists
        self._done = 0  # the number of the latest fill done (host side)
        self._done_changed = threading.Condition()

    @property
    def device_wait(self) -> bool:
        """Whether masks may be handed over before their fill ends (``DEVICE_WAIT``, and on
        CUDA the driver's stream wait): their upload, or on the CPU their copy, waits for it."""
        return DEVICE_WAIT and (self.device.type == "cpu" or self._wait_value is not None)

    def filled(self, fill: int) -> None:
        """Marks fill number ``fill`` written (any thread; numbers only grow): an upload
        queued to wait for it may start."""
        if self._filled is not None:  # as an int32 wraps (the device compares cyclically)
            self._filled[0] = (fill + 2**31) % 2**32 - 2**31
        with self._done_changed:
            self._done = fill
            self._done_changed.notify_all()

    def take(self) -> Masks:
        """The next buffers in turn, once their host buffer's last upload has finished (made
        on first use)."""
        if not self._buffers:
            cuda = self.device.type == "cuda"
            if cuda:
                self._copy_stream = torch.cuda.Stream(self.device)
                self._filled = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                self._wait_value = _driver_wait_value()
                if self._wait_value is not None and self._queue_wait(0) != 0:
                    self._wait_value = None  # no stream waits on memory here: the host waits
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

    def wait_filled(self, fill: int) -> None:
        """Blocks until fill number ``fill`` is written (:meth:`filled`)."""
        with self._done_changed:
            self._done_changed.wait_for(lambda: self._done >= fill)

    def _upload(self, masks: Masks, rows: int, fill: int | None) -> None:
        """The first ``rows`` rows of the pinned buffer copied to the device buffer on the
        copy stream, after the sampler that last read the device buffer, and with ``fill``
        (:attr:`device_wait` only) once fill number ``fill`` is written (:meth:`filled`);
        the ``copied`` event marks the end of the latest copy."""
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            if fill is not None:
                status = self._queue_wait(fill)
                if status != 0:
                    raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {status}")
            stream.wait_event(masks.used)
            masks.dev[:rows].copy_(masks.host[:rows], non_blocking=True)
            masks.copied.record(stream)

    def _queue_wait(self, fill: int) -> int:
        """Queues on the copy stream a wait until the pinned counter reaches ``fill`` (a
        cyclic >=); the driver's status (0: queued)."""
        return self._wait_value(self._copy_stream.cuda_stream, self._filled.data_ptr(),
                                fill & 0xFFFFFFFF, 0)

    def hand_over(self, masks: Masks, rows: int, fill: int | None = None) -> torch.Tensor:
        """The first ``rows`` masks for the sampler about to be queued on the current stream,
        with ``fill`` once fill number ``fill`` is written: on CUDA the device rows, their
        upload queued here (the stream waits for it; the buffer's next upload waits for that
        sampler, see :meth:`mark_read`), on the CPU a copy of the host rows."""
        if masks.dev is None:
            if fill is not None:
                self.wait_filled(fill)
            return masks.host[:rows].clone()
        self._upload(masks, rows, fill)
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self._reading = masks
        return masks.dev[:rows]

    def mark_read(self) -> None:
        """Records, on the current stream, that the sampler given the last handed-over masks
        has been queued (called after its launch)."""
        if self._reading is not None:
            self._reading.used.record(torch.cuda.current_stream(self.device))
            self._reading = None


def _driver_wait_value() -> Callable | None:
    """The CUDA driver's ``cuStreamWaitValue32`` (stream, address, value, flags; flags 0: wait
    until ``*address >= value``, cyclically), or None where it cannot be found. Pinned host
    memory is mapped at its own address under unified addressing, so the counter's pointer
    is the device address."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None
