"""Sampler results: ``SamplerOutput`` (device tensors) and ``AsyncOutput`` (host copy).

``AsyncOutput(out)`` starts the device-to-host copy at once: on CUDA it runs on a dedicated
copy stream (which first waits for the compute stream), into pinned host buffers, and records
an event; ``get()`` waits on that event only, never on a full device sync. On CPU it is a plain
copy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

_FIELDS = ("token_ids", "logprobs", "ranks", "topk_ids", "topk_values")


@dataclass(slots=True)
class SamplerOutput:
    """One step's results, on the device of the logits.

    Attributes:
        token_ids: ``[rows]`` int64 sampled ids.
        logprobs: ``[rows]`` float32 value of the sampled token in the row's logprobs mode
            (NaN for rows that did not ask), or None when no row asked.
        ranks: ``[rows]`` int64 rank of the sampled token (1 = best; 0 for rows that did not
            ask), or None.
        topk_ids: ``[rows, K]`` int64, K = the largest request of the batch, sorted by value
            descending then id, padded with -1; None when K = 0.
        topk_values: ``[rows, K]`` float32, padded with -inf; None when K = 0.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_values: torch.Tensor | None = None


@dataclass(slots=True)
class HostOutput:
    """The numpy copy of a :class:`SamplerOutput` (same fields, ``np.ndarray`` or None)."""

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_values: np.ndarray | None = None


class AsyncOutput:
    """Copies a :class:`SamplerOutput` to the host without blocking the compute stream.

    Args:
        output: the device results of a step.
        copy_stream: CUDA only: the stream that runs the copies (default: one shared side
            stream per device).

    Example:
        >>> out = SamplerOutput(token_ids=torch.tensor([3, 1]))
        >>> AsyncOutput(out).get().token_ids
        array([3, 1])
    """

    _streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self, output: SamplerOutput, copy_stream: "torch.cuda.Stream | None" = None):
        self._host: dict[str, torch.Tensor | None] = {}
        self._event = None
        self._result: HostOutput | None = None
        device = output.token_ids.device
        if device.type != "cuda":
            for name in _FIELDS:
                value = getattr(output, name)
                self._host[name] = None if value is None else value.detach().to("cpu", copy=True)
            return
        if copy_stream is None:
            copy_stream = self._streams.get(device)
            if copy_stream is None:
                copy_stream = self._streams[device] = torch.cuda.Stream(device=device)
        copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copy_stream):
            for name in _FIELDS:
                value = getattr(output, name)
                if value is None:
                    self._host[name] = None
                    continue
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                host.copy_(value, non_blocking=True)
                value.record_stream(copy_stream)
                self._host[name] = host
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)

    def is_ready(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        return self._event is None or self._event.query()

    def get(self) -> HostOutput:
        """Waits for this copy (its event only) and returns the numpy arrays.

        Returns:
            A :class:`HostOutput` whose arrays stay valid (they are not reused).
        """
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = HostOutput(
                **{k: None if v is None else v.numpy() for k, v in self._host.items()}
            )
        return self._result


assert tuple(f.name for f in fields(SamplerOutput)) == _FIELDS
