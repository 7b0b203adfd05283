"""``toolkit.generate``: in-process generation (no Ray) with the raygen engine."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from actors.engine.generation_output import GenerationOutput
    from actors.engine.llm_engine import Engine

_cache_lock = threading.Lock()
_cached: tuple[str, Engine] | None = None


def _normalise_prompts(prompts: Any) -> list[Any]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, Mapping) for p in prompts):
        return [prompts]  # one chat conversation
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one token-id prompt
    return prompts


def _engine_for(model: str, engine_options: dict[str, Any]) -> Engine:
    """The engine for (model, options): reused while the same pair is asked for."""
    global _cached
    from actors.engine.engine_config import EngineConfig
    from actors.engine.llm_engine import Engine

    config = EngineConfig.from_dict(engine_options)
    key = json.dumps([str(model), config.to_dict()], sort_keys=True, default=str)
    with _cache_lock:
        if _cached is not None and _cached[0] == key:
            return _cached[1]
        if _cached is not None:  # free the previous engine (and its ranks) before another
            _cached[1].close()
        _cached = None
        engine = Engine(str(model), config)
        _cached = (key, engine)
        return engine


def clear_engine_cache() -> None:
    """Drops the engine kept between ``generate`` calls (frees its model and KV memory, and
    ends its other tensor-parallel ranks)."""
    global _cached
    with _cache_lock:
        if _cached is not None:
            _cached[1].close()
        _cached = None


def generate(
    prompts: str | Sequence[Any],
    params: Any = None,
    *,
    model: str,
    **engine_options: Any,
) -> list[GenerationOutput]:
    """Generates in this process with the raygen engine.

    Args:
        prompts: strings, token-id lists, or chat message lists (``[{"role", "content"}]``,
            rendered with the tokenizer's chat template); a single string, token-id list or
            chat is accepted too.
        params: one ``SamplingParams`` (or dict) for every prompt, or a list with one per
            prompt; None uses the defaults.
        model: local directory or hub id.
        **engine_options: ``EngineConfig`` fields (``max_num_seqs``, ``dtype``, ...). The engine
            is kept and reused by the next call with the same model and options.
            ``tensor_parallel_size=2`` splits the model over this process and a child process
            (ended by ``clear_engine_cache()``, by a call with other options, or at exit).

    Returns:
        One ``GenerationOutput`` per (prompt, sample), in prompt order then ``sample_index``;
        ``id`` is the prompt's position. A bad prompt or bad params give that prompt
        ``finish_reason="error"`` rows instead of raising.

    Example:
        >>> from toolkit import SamplingParams, generate  # doctest: +SKIP
        >>> outs = generate(["Hello"], SamplingParams(max_tokens=8, seed=1),
        ...                 model="/tmp/tiny-llama")  # doctest: +SKIP
        >>> outs[0].output_text  # doctest: +SKIP
    """
    from actors.actor import params_per_prompt

    items = _normalise_prompts(prompts)
    per_prompt = params_per_prompt(params, len(items))
    engine = _engine_for(model, engine_options)
    return engine.generate([(i, p, sp) for i, (p, sp) in enumerate(zip(items, per_prompt))])
