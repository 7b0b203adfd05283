"""Argument checks shared by the Sampler and sample_logits (``ValueError`` naming the argument)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from sampler.seeding import SEED_BOUND


def as_token_array(
    name: str, value: Any, vocab_size: int, *, allow_placeholder: bool = False
) -> np.ndarray:
    """A 1-d int64 array of token ids in ``[0, vocab_size)`` (and -1 if allowed).

    Raises:
        ValueError: naming ``name`` when the value is not a sequence of ints or an id is out
            of range.
    """
    if value is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name}: must be a sequence of token ids, got {value!r:.80}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a sequence of token ids") from None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{name}: must be a flat sequence of integer token ids")
    array = array.astype(np.int64)
    low = -1 if allow_placeholder else 0
    if array.min() < low or array.max() >= vocab_size:
        bad = (array < low) | (array >= vocab_size)
        rule = "in [0, vocab_size)" + (" or -1 (not known yet)" if allow_placeholder else "")
        raise ValueError(f"{name}: token ids must be {rule} with vocab_size={vocab_size}, "
                         f"got {int(array[bad][0])}")
    return array


def as_token_arrays(
    name: str, values: Sequence[Any], vocab_size: int, *, allow_placeholder: bool = False
) -> list[np.ndarray]:
    """:func:`as_token_array` of each entry (private copies), the 1-d integer arrays among
    them checked and copied together: one range check for a whole admission."""
    out: list[Any] = [None] * len(values)
    flat, where = [], []
    for k, value in enumerate(values):
        if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu":
            flat.append(value)
            where.append(k)
        elif isinstance(value, (list, tuple)) and not value:
            out[k] = np.zeros(0, dtype=np.int64)
        else:
            out[k] = as_token_array(name, value, vocab_size, allow_placeholder=allow_placeholder)
    if flat:
        joined = np.concatenate(flat).astype(np.int64, copy=False)
        low = -1 if allow_placeholder else 0
        if joined.size and (joined.min() < low or joined.max() >= vocab_size):
            for value in flat:  # the entry at fault raises, naming its id
                as_token_array(name, value, vocab_size, allow_placeholder=allow_placeholder)
        start = 0  # the joined copy's pieces: private to the caller's arrays
        for k, value in zip(where, flat):
            out[k] = joined[start:start + len(value)]
            start += len(value)
    return out


def as_seed(value: Any) -> int:
    """A seed in ``[0, 2**63)``; raises ValueError naming ``seed`` otherwise."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_BOUND:
        raise ValueError(f"seed: must be an int in [0, 2**63), got {value!r}")
    return value


def as_bad_words(value: Sequence[Sequence[int]] | None, vocab_size: int) -> list[list[int]]:
    """Tokenized bad words: non-empty lists of in-vocab ids."""
    if not value:
        return []
    words = []
    for word in value:
        array = as_token_array("bad_words_token_ids", word, vocab_size)
        if array.size == 0:
            raise ValueError("bad_words_token_ids: every word must have at least one token")
        words.append(array.tolist())
    return words


def check_logits(logits: Any, vocab_size: int | None = None) -> torch.Tensor:
    """Checks a ``[rows, vocab]`` float32/bf16/fp16 tensor; returns it."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits: must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits: must be 2-d [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits: dtype must be float32, bfloat16 or float16, got {logits.dtype}")
    if vocab_size is not None and logits.shape[1] != vocab_size:
        raise ValueError(
            f"logits: expected {vocab_size} columns (vocab padding sliced off), "
            f"got {logits.shape[1]}"
        )
    return logits
