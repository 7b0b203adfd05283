"""GenerationOutput: one finished (prompt, sample) row, with the output schema's attributes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort", "error"]

#: The attributes that map one-to-one onto the Parquet output columns (docs/design.md).
SCHEMA_FIELDS: tuple[str, ...] = (
    "id",
    "sample_index",
    "output_text",
    "output_token_ids",
    "finish_reason",
    "stop_reason",
    "stop_token_id",
    "logprobs",
    "top_logprobs",
    "sampled_ranks",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_top_logprobs",
    "num_prompt_tokens",
    "num_output_tokens",
    "seed",
    "error",
)


class TopLogprobs(Sequence):
    """The top-k of every generated step, held as two ``[steps, k]`` arrays (``token_ids``,
    ``logprobs``) and read as a sequence of steps, each a list of ``{"token_id", "logprob"}``
    dicts in descending order; it compares equal to that list of lists, and ``to_list()``
    builds it. Keeping arrays saves a dict per entry per step on the engine's host path; the
    output table reads the arrays directly.

    Example:
        >>> top = TopLogprobs(np.array([[7, 3]]), np.array([[-0.5, -1.5]], np.float32))
        >>> top[0]
        [{'token_id': 7, 'logprob': -0.5}, {'token_id': 3, 'logprob': -1.5}]
    """

    __slots__ = ("token_ids", "logprobs")

    def __init__(self, token_ids: np.ndarray, logprobs: np.ndarray):
        if token_ids.shape != logprobs.shape or token_ids.ndim != 2:
            raise ValueError(f"top logprobs: token_ids {token_ids.shape} and logprobs "
                             f"{logprobs.shape} must be the same [steps, k] shape")
        self.token_ids, self.logprobs = token_ids, logprobs

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return [{"token_id": t, "logprob": v} for t, v in
                zip(self.token_ids[index].tolist(), self.logprobs[index].tolist())]

    def to_list(self) -> list[list[dict[str, Any]]]:
        return [[{"token_id": t, "logprob": v} for t, v in zip(ids, values)]
                for ids, values in zip(self.token_ids.tolist(), self.logprobs.tolist())]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TopLogprobs):
            return (np.array_equal(self.token_ids, other.token_ids)
                    and np.array_equal(self.logprobs, other.logprobs))
        if isinstance(other, (list, tuple)):
            return self.to_list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TopLogprobs({self.to_list()!r})"

    def __reduce__(self):
        return TopLogprobs, (self.token_ids, self.logprobs)


@dataclass(slots=True)
class GenerationOutput:
    """The result of one sample of one request.

    Attributes:
        id: the request id given to ``add_request``.
        sample_index: 0..n-1.
        output_text: detokenized output (stop string removed unless asked), None when the
            request set ``detokenize=False`` or failed before generating.
        output_token_ids: generated ids (a stop id that ended the row is included).
        finish_reason: "stop", "length", "abort" or "error".
        stop_reason: as vLLM's: the stop string (str) or the stop token id (int) that ended
            the sample; None when it ended otherwise, an EOS token included (finish_reason
            "stop"). In the output table a stop string is ``stop_reason`` and a stop id
            ``stop_token_id``.
        logprobs: the sampled token's value per step in the row's ``logprobs_mode``, or None
            when ``logprobs`` was not requested.
        top_logprobs: per step, the top-k ``{"token_id", "logprob"}`` pairs (descending), when
            ``logprobs > 0`` (or -1: the whole vocab); else None. The engine fills it with a
            :class:`TopLogprobs` (reads as that list of lists; ``to_dict`` gives plain lists).
        sampled_ranks: rank of the sampled token per step (1 = argmax), when logprobs requested.
        prompt_logprobs: log P(prompt[i] | prompt[:i]) per prompt position, element 0 None,
            when ``prompt_logprobs`` was requested.
        prompt_token_ids: the prompt's token ids, when ``prompt_logprobs`` was requested
            (so the values can be matched to tokens).
        num_prompt_tokens, num_output_tokens: counts.
        seed: this sample's seed: ``n=1`` with this seed reproduces the sample alone (sample
            ``j`` of a request seeded ``s`` draws with ``sampler.seeding.sample_seed(s, j)``).
        error: why the request failed (finish_reason "error"), else None.
        prompt_top_logprobs: top-k ``{"token_id", "logprob"}`` pairs per prompt position
            (element 0 None) when ``prompt_logprobs > 0``.
        raw_logprobs, temperature_logprobs: in memory only (RL rollouts): per sampled token,
            ``log_softmax(z)[t]`` and ``log_softmax(z / T)[t]`` from the untouched float32
            logits ``z`` (T = 1 for greedy rows), when the request asked for them; else None.
    """

    id: Any
    sample_index: int = 0
    output_text: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | list[list[dict[str, Any]]] | None = None
    sampled_ranks: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    seed: int | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_top_logprobs: list[list[dict[str, Any]] | None] | None = None
    raw_logprobs: list[float] | None = None
    temperature_logprobs: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The schema columns as a dict (``stop_reason`` split as in the table)."""
        out = {name: getattr(self, name) for name in SCHEMA_FIELDS}
        out["stop_reason"] = stop_string(self.stop_reason)
        if isinstance(self.top_logprobs, TopLogprobs):
            out["top_logprobs"] = self.top_logprobs.to_list()
        return out

    @property
    def stop_token_id(self) -> int | None:
        """The stop token id that ended the sample (the ``stop_token_id`` column), else None."""
        return stop_token(self.stop_reason)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def stop_string(stop_reason: Any) -> str | None:
    """The ``stop_reason`` column of a sample's stop reason: the stop string, else None."""
    return stop_reason if isinstance(stop_reason, str) else None


def stop_token(stop_reason: Any) -> int | None:
    """The ``stop_token_id`` column of a sample's stop reason: the stop id, else None."""
    if isinstance(stop_reason, bool) or not isinstance(stop_reason, (int, np.integer)):
        return None
    return int(stop_reason)


ALL_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationOutput))
