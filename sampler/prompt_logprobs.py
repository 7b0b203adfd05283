"""Prompt logprobs (docs/sampler.md §3), computed in bounded chunks of rows.

Prompt position i (i >= 1) holds log P(prompt[i] | prompt[:i]): the caller passes the logits
of positions 0..n-2 with the targets prompt[1..n-1] (position 0 has no value). The values come
from the raw logits; no sampling step applies to prompt positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sampler.ops.logprobs import compute_logprob_outputs
from sampler.sampler_output import SamplerOutput
from sampler.params import LogprobsMode

DEFAULT_CHUNK_ELEMENTS = 1 << 25  # fp32 working block per chunk: 128 MiB
_UNITS = {
    "raw_logprobs": "raw_logprobs",
    "raw_logits": "raw_logits",
    "temperature_logprobs": "temperature_logprobs",
    "processed_logprobs": "raw_logprobs",
    "processed_logits": "raw_logits",
}


def compute_prompt_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor | Sequence[int],
    num_logprobs: int = 0,
    *,
    mode: LogprobsMode = "raw_logprobs",
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> SamplerOutput:
    """Logprobs of given next tokens, with ranks and optional top-k, chunk by chunk.

    Args:
        logits: ``[num_tokens, vocab]`` float32/bf16/fp16 (any strides), the raw logits of
            the positions that predict ``target_ids``.
        target_ids: ``[num_tokens]`` int, the next prompt token of each position.
        num_logprobs: 0 = the target only; k > 0 = top-k too; -1 = the whole vocab.
        mode: "raw_logprobs" (default), "raw_logits" or "temperature_logprobs"; the processed
            modes have no meaning on prompt positions and give the raw values of the same
            unit (processed_logprobs -> raw_logprobs, processed_logits -> raw_logits).
        temperature: for "temperature_logprobs": log_softmax(logits / T); 0 (greedy) means 1.
        chunk_size: rows per chunk (default: as many as fit in 2**25 float32 elements), so an
            8k-token prompt over a 152k vocab never materialises a 5 GB block.

    Returns:
        :class:`~sampler.sampler_output.SamplerOutput` with ``token_ids`` = the targets,
        ``logprobs [num_tokens]`` float32, ``ranks [num_tokens]`` int64 and, for
        ``num_logprobs != 0``, ``topk_ids`` / ``topk_values`` ``[num_tokens, K]``.

    Raises:
        ValueError: naming the argument, for mismatched shapes, out-of-vocab targets, a bad
            ``num_logprobs``, ``mode``, ``temperature`` or ``chunk_size``.

    Example:
        >>> out = compute_prompt_logprobs(torch.zeros(2, 4), [1, 3], num_logprobs=2)
        >>> out.ranks
        tensor([1, 1])
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits: must be a 2-d tensor [num_tokens, vocab]")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits: dtype must be float32, bfloat16 or float16, got {logits.dtype}")
    num_tokens, vocab = logits.shape
    on_device = isinstance(target_ids, torch.Tensor) and target_ids.device.type != "cpu"
    targets = torch.as_tensor(target_ids, dtype=torch.int64)
    if targets.shape != (num_tokens,):
        raise ValueError(f"target_ids: expected shape [{num_tokens}], got {tuple(targets.shape)}")
    if not on_device and num_tokens and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"target_ids: ids must be in [0, {vocab})")  # host data: no sync
    targets = targets.to(logits.device)
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or not (
        -1 <= num_logprobs <= vocab
    ):
        raise ValueError(f"num_logprobs: must be -1 or in [0, {vocab}], got {num_logprobs!r}")
    if mode not in _UNITS:
        raise ValueError(f"mode: must be one of {', '.join(_UNITS)}, got {mode!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature: must be a number >= 0, got {temperature!r}")
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be an int >= 1, got {chunk_size!r}")
    unit = _UNITS[mode]
    width = vocab if num_logprobs == -1 else num_logprobs
    per_row = torch.full((num_tokens,), num_logprobs, dtype=torch.int64, device=logits.device)
    parts = []
    for start in range(0, num_tokens, chunk_size):
        chunk = logits[start:start + chunk_size]
        if unit == "raw_logprobs":
            values = torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
        elif unit == "raw_logits":
            values = chunk.float()
        else:
            values = torch.log_softmax(chunk.float() / (temperature or 1.0), dim=-1)
        parts.append(compute_logprob_outputs(
            values, targets[start:start + chunk_size], per_row[start:start + chunk_size], width
        ))
    if not parts:
        empty_f = torch.empty(0, dtype=torch.float32, device=logits.device)
        empty_i = torch.empty(0, dtype=torch.int64, device=logits.device)
        return SamplerOutput(
            targets, empty_f, empty_i,
            empty_i.reshape(0, width) if width else None,
            empty_f.reshape(0, width) if width else None,
        )
    logprobs, ranks, ids, vals = (
        None if parts[0][j] is None else torch.cat([p[j] for p in parts]) for j in range(4)
    )
    return SamplerOutput(targets, logprobs, ranks, ids, vals)
