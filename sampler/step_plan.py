"""Host-side predicates of one step: which pipeline steps run (no device sync).

They are computed from the host mirrors of :class:`~sampler.state.SamplerState`, over the
batch's slots when the host knows them, else over every active slot (a superset: the ops stay
exact for rows that do not need them, they only cost time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sampler.ops.logprobs import OFF
from sampler.slot_params import (
    HAS_ALLOWED,
    IS_GREEDY,
    LOG_MIN_P,
    MIN_TOKENS,
    MODE,
    MODE_CODES,
    NUM_LOGPROBS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)
from sampler.state import SamplerState

# logprobs modes computed from the raw logits (their top-k needs no processed values)
RAW_FAMILY = tuple(MODE_CODES[m] for m in ("raw_logprobs", "raw_logits", "temperature_logprobs"))


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Which steps a batch needs.

    Attributes:
        any_greedy, any_random: whether some row is greedy / random.
        do_allowed, do_bad_words, do_min_tokens, do_logit_bias, do_penalties: masks and
            penalties (steps 2–6).
        do_grammar: the step carries grammar masks (``Sampler.sample(token_bitmask=)``, step
            2: applied after the raw snapshot, before the other masks).
        do_temperature, do_min_p, do_top_k, do_top_p: steps 8–11 (random rows only).
        max_top_k: the largest active top-k (0 when none).
        all_top_k: every random row has an active top-k (vacuously true with none).
        any_seeded: some random row's request set its own seed (its draw must be the
            counter-based one of the seed; the FlashInfer backend cannot give it).
        modes: the logprobs-mode codes of the rows that asked for logprobs.
        max_num_logprobs: K, the top-k output width (vocab size if a row asked for -1).
        min_select_k, max_select_k: over the rows, the fewest / most tokens a row's step
            must rank: a random row's top-k (the vocab size without one), a greedy row's 0,
            or its raw-family top logprobs when larger (the Triton candidate path takes the
            rows whose count is small).
    """

    any_greedy: bool
    any_random: bool
    do_allowed: bool = False
    do_grammar: bool = False
    do_bad_words: bool = False
    do_min_tokens: bool = False
    do_logit_bias: bool = False
    do_penalties: bool = False
    do_temperature: bool = False
    do_min_p: bool = False
    do_top_k: bool = False
    do_top_p: bool = False
    max_top_k: int = 0
    all_top_k: bool = False
    any_seeded: bool = False
    modes: frozenset[int] = frozenset()
    max_num_logprobs: int = 0
    min_select_k: int = 0
    max_select_k: int = 0

    @property
    def mutates(self) -> bool:
        """Whether any step writes the working logits."""
        return (
            self.do_allowed or self.do_grammar or self.do_bad_words or self.do_min_tokens
            or self.do_logit_bias
            or self.do_penalties or self.do_temperature or self.do_min_p or self.do_top_k
            or self.do_top_p
        )

    @property
    def any_logprobs(self) -> bool:
        return bool(self.modes)


def make_plan(state: SamplerState, rows_host: np.ndarray | None) -> StepPlan:
    """Derives the step plan from the host mirrors.

    Args:
        state: the sampler state (host mirrors up to date with add/remove).
        rows_host: the batch's slots as a host int array, or None when only the device knows
            them (then every active slot counts).

    Returns:
        The :class:`StepPlan` of the batch.
    """
    sel = rows_host if rows_host is not None else np.flatnonzero(state.active)
    f = state.fparams_host[sel]
    i = state.iparams_host[sel]
    greedy = i[:, IS_GREEDY] != 0
    random = ~greedy
    vocab = state.vocab_size
    k = i[:, TOP_K]
    k_active = random & (k > 0) & (k < vocab)
    num_logprobs = i[:, NUM_LOGPROBS]
    asked = num_logprobs != OFF
    width = np.where(num_logprobs == -1, vocab, num_logprobs)
    widths = width[asked]
    raw_family = np.isin(i[:, MODE], RAW_FAMILY)
    select = np.maximum(np.where(random, np.where(k_active, k, vocab), 0),
                        np.where(asked & raw_family & (num_logprobs != 0), width, 0))
    return StepPlan(
        any_greedy=bool(greedy.any()),
        any_random=bool(random.any()),
        do_allowed=bool((i[:, HAS_ALLOWED] != 0).any()),
        do_bad_words=bool(state.has_bad_words[sel].any()),
        do_min_tokens=bool((i[:, MIN_TOKENS] > state.pos_host[sel]).any()),
        do_logit_bias=bool(state.has_bias[sel].any()),
        do_penalties=bool(state.has_penalties[sel].any()),
        do_temperature=bool((random & (f[:, TEMPERATURE] != 1.0)).any()),
        do_min_p=bool((random & (f[:, LOG_MIN_P] > -math.inf)).any()),
        do_top_k=bool(k_active.any()),
        do_top_p=bool((random & (f[:, TOP_P] < 1.0)).any()),
        max_top_k=int(k[k_active].max()) if k_active.any() else 0,
        all_top_k=not bool((random & ~k_active).any()),
        any_seeded=bool((random & state.has_seed[sel]).any()),
        modes=frozenset(int(m) for m in np.unique(i[asked, MODE])),
        max_num_logprobs=int(widths.max()) if widths.size else 0,
        min_select_k=int(select.min()) if select.size else 0,
        max_select_k=int(select.max()) if select.size else 0,
    )


class PlanCache:
    """The last step's plan, reused while neither the state's requests nor the batch's slots
    changed (a steady decode batch). Only ``do_min_tokens`` moves with the positions; they
    only grow while the requests stay, so once it is off it stays off, and while it is on it
    is re-derived each step from the batch's min_tokens, which the cache keeps."""

    __slots__ = ("_version", "_rows", "_plan", "_min_tokens")

    def __init__(self) -> None:
        self._version = -1
        self._rows: np.ndarray | None = None
        self._plan: StepPlan | None = None
        self._min_tokens: np.ndarray | None = None

    def get(self, state: SamplerState, rows_host: np.ndarray | None) -> StepPlan:
        """:func:`make_plan` of ``(state, rows_host)``, from the cache when it holds."""
        if rows_host is None:  # the slots are known on the device only
            return make_plan(state, rows_host)
        plan = self._plan
        if (plan is None or state.version != self._version
                or not np.array_equal(rows_host, self._rows)):
            plan = make_plan(state, rows_host)
            self._version, self._rows, self._plan = state.version, rows_host.copy(), plan
            self._min_tokens = state.iparams_host[rows_host, MIN_TOKENS]
        elif plan.do_min_tokens and not (self._min_tokens > state.pos_host[rows_host]).any():
            plan = self._plan = replace(plan, do_min_tokens=False)
        return plan
