"""Turns ``(request_id, prompt, params)`` into a validated ``Request`` or a reason why not.

Prompts are strings (encoded by the tokenizer), token-id lists, or chat message lists
(rendered by the tokenizer's chat template with the generation prompt). Every problem raises
``ValueError`` with a message that says what is wrong; the engine turns it into an error
output for that request only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from actors.engine.sequence import Request
from sampler.params import SamplingParams
from sampler.seeding import derive_seed


class InputProcessor:
    """Validates requests against the model and the engine limits.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: logit width; token ids must be below it.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        max_model_len, max_num_seqs, max_logprobs, num_kv_blocks, block_size, base_seed:
            engine limits and the seed unseeded requests derive theirs from.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: list[int],
                 max_model_len: int, max_num_seqs: int, max_logprobs: int,
                 num_kv_blocks: int, block_size: int, base_seed: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.base_seed = base_seed

    def resolve_seed(self, request_id: Any, params: SamplingParams | None) -> int:
        """The request's own seed, else one derived from the engine seed and the id."""
        if params is not None and params.seed is not None:
            return params.seed
        key = request_id if isinstance(request_id, (int, str, bytes, tuple)) \
            and not isinstance(request_id, bool) else str(request_id)
        return derive_seed(self.base_seed, key)

    def describe(self, request_id: Any, params: Any) -> tuple[int, int | None]:
        """(n, seed) of a request for its error rows, as far as its params can be read."""
        try:
            parsed = SamplingParams.coerce(params)
        except Exception:  # noqa: BLE001 - unreadable params: one error row
            parsed = None
        try:
            seed = self.resolve_seed(request_id, parsed)
        except ValueError:
            seed = None
        return (parsed.n if parsed is not None else 1), seed

    def coerce_params(self, params: Any) -> SamplingParams:
        params = SamplingParams.coerce(params)
        params.verify_for_model(self.vocab_size, max_logprobs=self.max_logprobs,
                                max_model_len=self.max_model_len)
        if params.n > self.max_num_seqs:
            raise ValueError(f"sampling_params.n: must be <= max_num_seqs "
                             f"({self.max_num_seqs}), got {params.n}")
        return params

    def tokenize(self, prompt: Any) -> list[int]:
        """Prompt (str | list[int] | list[dict]) -> token ids, checked against the vocab."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(
                isinstance(m, Mapping) for m in prompt):
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in prompt], add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) or (
                hasattr(prompt, "tolist") and getattr(prompt, "ndim", 0) == 1):
            ids = _as_token_ids(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size}), got "
                                 f"{bad[:5]}")
        else:
            raise ValueError("prompt: expected a string, a list of token ids or a list of chat "
                             f"messages, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: is empty (no tokens)")
        return list(ids)

    def build(self, request_id: Any, prompt: Any, params: Any, arrival: int) -> Request:
        """A validated Request; raises ``ValueError`` saying why not."""
        params = self.coerce_params(params)
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room for output within "
                             f"max_model_len={self.max_model_len}")
        pages = math.ceil((len(ids) + 1) / self.block_size) + params.n - 1
        if pages > self.num_kv_blocks:
            raise ValueError(f"prompt: {len(ids)} tokens with n={params.n} need {pages} KV "
                             f"blocks, the cache has {self.num_kv_blocks}")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            prompt_array=np.fromiter(ids, dtype=np.int64, count=len(ids)),
            params=params,
            seed=self.resolve_seed(request_id, params),
            arrival=arrival,
            bad_words_token_ids=self._bad_words(params.bad_words),
            stop_token_ids=frozenset(stop_ids),
            num_unfinished=params.n,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(ids)
            if params.prompt_logprobs != 0:
                request.prompt_top_logprobs = [None] * len(ids)
        return request

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(list(ids))
        return out


def _as_token_ids(values: list[Any] | tuple[Any, ...]) -> list[Any]:
    """The ids as Python ints (numpy / torch scalars converted); raises on anything else,
    bools included."""
    if set(map(type, values)) <= _PLAIN_INT:  # the usual list of ints: one C-level pass
        return list(values)
    out = []
    for v in values:
        if hasattr(v, "item") and not isinstance(v, (list, tuple)):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"prompt: token ids must be integers, got {v!r}")
        out.append(v)
    return out


_PLAIN_INT = frozenset({int})
