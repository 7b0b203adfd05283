"""A request's rows of the sampler's slot tables (:class:`SlotParams`), made once per request
and written into a slot at each admission of one of its samples
(:meth:`sampler.state.SamplerState.add_requests`); the tables' column layout."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sampler.ops.logprobs import OFF
from sampler.params import LOGPROBS_MODES, SamplingParams

# float32 columns of ``fparams``
TEMPERATURE, TOP_P, LOG_MIN_P, REPETITION, FREQUENCY, PRESENCE = range(6)
# int64 columns of ``iparams``
SEED, SAMPLE_INDEX, TOP_K, MIN_TOKENS, NUM_LOGPROBS, MODE, IS_GREEDY, HAS_ALLOWED = range(8)
MODE_CODES = {mode: code for code, mode in enumerate(LOGPROBS_MODES)}
NEUTRAL_F = (1.0, 1.0, -math.inf, 1.0, 0.0, 0.0)  # a free slot's rows
NEUTRAL_I = (0, 0, 0, 0, OFF, 0, 0, 0)
NO_IDS = np.zeros(0, dtype=np.int64)  # a slot's specials when it has none (never written)
NO_IDS.flags.writeable = False


@dataclass(frozen=True, slots=True)
class SlotParams:
    """A request's rows of the slot tables (:func:`slot_params`), written into a
    slot at each admission of one of its samples."""

    f: tuple[float, ...]  # the fparams row
    i: tuple[int, ...]  # the iparams row, its seed and sample index neutral
    stops: tuple[int, ...]  # stop ids and EOS ids
    bias_ids: tuple[int, ...]
    bias_values: tuple[float, ...]
    words: tuple[tuple[int, ...], ...]  # bad words, tokenized
    allowed: np.ndarray | None
    specials: np.ndarray  # bias ids, stop ids (with min_tokens), bad words' last tokens
    penalties: bool
    has_seed: bool  # the request set its own seed (params.seed)


def slot_params(params: SamplingParams, eos_token_ids: list[int],
                bad_words: list[list[int]]) -> SlotParams:
    """A (validated) request's rows; the same for every slot and every admission of it."""
    f, i = list(NEUTRAL_F), list(NEUTRAL_I)
    greedy = params.temperature == 0.0
    if not greedy:
        f[TEMPERATURE] = params.temperature
        f[TOP_P] = params.top_p
        f[LOG_MIN_P] = math.log(params.min_p) if params.min_p > 0 else -math.inf
        i[TOP_K] = params.top_k
    f[REPETITION] = params.repetition_penalty
    f[FREQUENCY] = params.frequency_penalty
    f[PRESENCE] = params.presence_penalty
    i[IS_GREEDY] = greedy
    i[MIN_TOKENS] = params.min_tokens
    i[NUM_LOGPROBS] = OFF if params.logprobs is None else params.logprobs
    i[MODE] = MODE_CODES[params.logprobs_mode]
    i[HAS_ALLOWED] = params.allowed_token_ids is not None
    stops = tuple(dict.fromkeys([*params.stop_token_ids, *eos_token_ids]))
    bias = params.logit_bias or {}
    words = tuple(tuple(w) for w in bad_words)
    specials = [*bias.keys(), *(w[-1] for w in words if w)]
    if params.min_tokens > 0:
        specials += stops
    return SlotParams(
        f=tuple(f), i=tuple(i), stops=stops, bias_ids=tuple(bias.keys()),
        bias_values=tuple(bias.values()), words=words,
        allowed=None if params.allowed_token_ids is None
        else np.asarray(params.allowed_token_ids, dtype=np.int64),
        specials=np.asarray(specials, dtype=np.int64) if specials else NO_IDS,
        penalties=params.needs_penalties, has_seed=params.seed is not None)
