"""SamplingParams: the per-request knobs of the sampler and of the stop logic.

Field names and defaults follow vLLM; the rules are those of docs/sampler.md §1. Every violation
raises ``ValueError`` naming the field and the bound; wrong types raise ``ValueError`` too (the
values usually come from data files, where a type error is a data error).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Literal, get_args

from sampler.param_fields import (as_bool, as_float, as_int, as_int_list, as_str_list,
                                  check_logprobs, field_error)
from sampler.structured_params import StructuredOutputsParams

LogprobsMode = Literal[
    "raw_logprobs",
    "raw_logits",
    "processed_logprobs",
    "processed_logits",
    "temperature_logprobs",
]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
RAW_MODES = frozenset({"raw_logprobs", "raw_logits", "temperature_logprobs"})
PROCESSED_MODES = frozenset({"processed_logprobs", "processed_logits"})

MIN_TEMPERATURE = 0.01
_SEED_MAX = 2**63 - 1
_REJECTED_FIELDS = {
    "best_of": "best_of is not supported: ask for n samples and rank them yourself",
}


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (docs/sampler.md §1).

    Args:
        n: number of samples drawn for the prompt (each its own noise stream).
        temperature: 0 = greedy; values in (0, 0.01) are raised to 0.01.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it (stored as 0).
        min_p: drop tokens less likely than ``min_p`` times the most likely one.
        presence_penalty, frequency_penalty: in [-2, 2], over output tokens.
        repetition_penalty: > 0, over prompt and output tokens.
        seed: the noise seed; None (or -1) lets the engine derive one and report it.
        max_tokens: output budget; None = up to the model length.
        min_tokens: EOS and stop ids are masked until this many tokens were produced.
        stop, stop_token_ids, include_stop_str_in_output, ignore_eos: stop conditions.
        logprobs: None off; 0 the sampled token; k > 0 top-k too; -1 the whole vocab.
        prompt_logprobs: as ``logprobs``, for the prompt positions.
        logprobs_mode: which values the logprobs carry (docs/sampler.md §3).
        logit_bias: token id -> additive bias.
        allowed_token_ids: if set, every other token is masked.
        bad_words: words whose last token is masked after their prefix was generated.
        detokenize, skip_special_tokens, spaces_between_special_tokens: text output.
        structured_outputs: a constraint on the text (:class:`StructuredOutputsParams`, or
            a mapping / JSON text of its fields), or None.

    Example:
        >>> p = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, seed=1)
        >>> SamplingParams.from_dict({"top_k": 5}, defaults=p).top_k
        5
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: LogprobsMode = "raw_logprobs"
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = as_int("n", self.n)
        if self.n < 1:
            raise field_error("n", "must be >= 1", self.n)

        self.temperature = as_float("temperature", self.temperature)
        if self.temperature < 0:
            raise field_error("temperature", "must be >= 0", self.temperature)
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

        self.top_p = as_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise field_error("top_p", "must be in (0, 1]", self.top_p)

        self.top_k = as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise field_error("top_k", "must be -1, 0 (off) or >= 1", self.top_k)
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = as_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise field_error("min_p", "must be in [0, 1]", self.min_p)

        for name in ("presence_penalty", "frequency_penalty"):
            value = as_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise field_error(name, "must be in [-2, 2]", value)
            setattr(self, name, value)
        self.repetition_penalty = as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise field_error("repetition_penalty", "must be > 0", self.repetition_penalty)

        if self.seed is not None:
            self.seed = as_int("seed", self.seed)
            if self.seed == -1:
                self.seed = None
            elif not 0 <= self.seed <= _SEED_MAX:
                raise field_error("seed", f"must be None, -1 or in [0, {_SEED_MAX}]", self.seed)

        if self.max_tokens is not None:
            self.max_tokens = as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise field_error("max_tokens", "must be >= 1 or None", self.max_tokens)
        self.min_tokens = as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise field_error("min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise field_error(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens})", self.min_tokens
            )

        self.stop = as_str_list("stop", self.stop if self.stop is not None else [])
        ids = as_int_list("stop_token_ids", self.stop_token_ids or [])
        self.stop_token_ids = list(dict.fromkeys(ids))
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            setattr(self, name, as_bool(name, getattr(self, name)))
        if self.stop and not self.detokenize:
            raise field_error("stop", "stop strings need detokenize=True", self.stop)

        self.logprobs = check_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise field_error("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}",
                        self.logprobs_mode)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise field_error("logit_bias", "must be a mapping token id -> bias", self.logit_bias)
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                if isinstance(key, str):
                    try:
                        key = int(key)
                    except ValueError:
                        raise field_error("logit_bias", "keys must be token ids", key) from None
                key = as_int("logit_bias", key)
                if key < 0:
                    raise field_error("logit_bias", "token ids must be >= 0", key)
                bias[key] = as_float("logit_bias", value)
            self.logit_bias = bias or None

        if self.allowed_token_ids is not None:
            allowed = as_int_list("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise field_error("allowed_token_ids", "must be None or a non-empty list", allowed)
            self.allowed_token_ids = list(dict.fromkeys(allowed))

        self.bad_words = as_str_list("bad_words", self.bad_words or [])
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)

    def with_seed(self, seed: Any) -> SamplingParams:
        """A copy with ``seed`` set, validated as the constructor validates it (-1: no seed)."""
        seed = as_int("seed", seed)
        if seed == -1:
            seed = None
        elif not 0 <= seed <= _SEED_MAX:
            raise field_error("seed", f"must be None, -1 or in [0, {_SEED_MAX}]", seed)
        params = copy.copy(self)
        params.seed = seed
        return params

    # ------------------------------------------------------------------ derived flags
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def needs_raw_snapshot(self) -> bool:
        """Whether this request's logprobs are taken from the untouched logits."""
        return self.logprobs is not None and self.logprobs_mode in RAW_MODES

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    # ------------------------------------------------------------------ model checks
    def verify_for_model(
        self,
        vocab_size: int,
        *,
        max_logprobs: int = 20,
        max_model_len: int | None = None,
    ) -> None:
        """Checks the rules that depend on the model and the engine settings.

        Raises:
            ValueError: naming the field, when a token id is outside ``[0, vocab_size)`` or a
                logprobs count exceeds ``max_logprobs``.
        """
        for name in ("stop_token_ids", "allowed_token_ids"):
            for tok in getattr(self, name) or ():
                if tok >= vocab_size:
                    raise field_error(name, f"token ids must be < vocab size {vocab_size}", tok)
        for tok in self.logit_bias or ():
            if tok >= vocab_size:
                raise field_error("logit_bias", f"token ids must be < vocab size {vocab_size}", tok)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise field_error(name, f"must be <= max_logprobs ({max_logprobs}) or -1", value)
        if max_model_len is not None and self.min_tokens > max_model_len:
            raise field_error("min_tokens", f"must be <= max_model_len ({max_model_len})",
                        self.min_tokens)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any] | None,
        *,
        defaults: SamplingParams | Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """Builds params from a mapping, merged field by field over ``defaults``.

        ``None`` values in ``data`` mean "not given" (an Arrow struct row has a null for every
        field it does not set), so the default stays; to unset a default seed pass ``seed=-1``.
        Unknown fields and ``best_of`` raise ``ValueError`` naming them.
        """
        merged: dict[str, Any] = {}
        if defaults is not None:
            base = defaults.to_dict() if isinstance(defaults, SamplingParams) else dict(defaults)
            _check_names(base)
            merged.update({k: v for k, v in base.items() if v is not None})
        if data is not None:
            if not isinstance(data, Mapping):
                raise ValueError(
                    f"sampling_params: expected a mapping of field -> value, got {data!r}"
                )
            _check_names(data)
            merged.update({k: v for k, v in data.items() if v is not None})
        return cls(**merged)

    @classmethod
    def from_json(
        cls, text: str | bytes, *, defaults: SamplingParams | Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """Builds params from a JSON object string (the JSON form of a params column)."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sampling_params: not valid JSON ({exc}): {text!r:.200}") from None
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"sampling_params: JSON must be an object, got {text!r:.200}")
        return cls.from_dict(data, defaults=defaults)

    @classmethod
    def coerce(
        cls,
        value: Any,
        *,
        defaults: SamplingParams | Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """Accepts what a params column may hold: None, a SamplingParams, a mapping (an Arrow
        struct row as ``to_pylist`` gives it), a ``pyarrow.StructScalar`` or a JSON string."""
        if value is None:
            return cls.from_dict(None, defaults=defaults)
        if isinstance(value, SamplingParams):
            return cls.from_dict(value.to_dict(), defaults=defaults)
        if isinstance(value, (str, bytes)):
            return cls.from_json(value, defaults=defaults)
        if hasattr(value, "as_py") and callable(value.as_py):  # pyarrow scalar
            return cls.coerce(value.as_py(), defaults=defaults)
        if isinstance(value, Mapping):
            return cls.from_dict(value, defaults=defaults)
        raise ValueError(
            f"sampling_params: expected a struct, a mapping or a JSON string, got {value!r:.200}"
        )

    from_arrow = coerce

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict of every field (logit_bias keys stay ints)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("stop", "stop_token_ids", "bad_words", "allowed_token_ids"):
            if out[key] is not None:
                out[key] = list(out[key])
        if out["logit_bias"] is not None:
            out["logit_bias"] = dict(out["logit_bias"])
        if out["structured_outputs"] is not None:
            out["structured_outputs"] = out["structured_outputs"].to_dict()
        return out

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed."""
        _check_names(changes)
        return SamplingParams(**{**self.to_dict(), **changes})


FIELD_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _check_names(data: Mapping[str, Any]) -> None:
    for key in data:
        if key in _REJECTED_FIELDS:
            raise ValueError(f"sampling_params.{key}: {_REJECTED_FIELDS[key]}")
        if key not in FIELD_NAMES:
            raise ValueError(
                f"sampling_params: unknown field {key!r} (known: {', '.join(sorted(FIELD_NAMES))})"
            )
