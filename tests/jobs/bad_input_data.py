"""Hypothesis strategies for bad input rows: each drawn row knows whether it must fail and
which words its error must contain (the field it names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from sampler.params import FIELD_NAMES

MAX_MODEL_LEN = 40
MAX_NUM_SEQS = 8
VOCAB = 512  # the tiny test tokenizer's vocabulary
NAN, INF = float("nan"), float("inf")

# field -> (values that must be accepted, values that must be refused); the accepted ones
# combine freely with each other under the job defaults (max_tokens 2).
PARAMS: dict[str, tuple[list[Any], list[Any]]] = {
    "n": ([1, 2, 3], [0, -1, 1.5, "2", True, 10**9, MAX_NUM_SEQS + 1]),
    "temperature": ([0, 0.7, 1.5], [-1, NAN, INF, -INF, "hot", [1], 1e308 * 10]),
    "top_p": ([0.5, 1], [0, 1.5, -0.2, NAN]),
    "top_k": ([0, -1, 3], [-2, 2.5, "k"]),
    "min_p": ([0, 0.1], [-0.1, 2]),
    "presence_penalty": ([0.5, -1], [5, -INF]),
    "repetition_penalty": ([1.2], [0, -1, INF]),
    "seed": ([0, 7, 2**62, -1], [-2, 2**63, "abc", 1.5, [3]]),
    "max_tokens": ([1, 3, 10**6], [0, -5, 2.5, "x", {"a": 1}]),
    "min_tokens": ([0], [-1, 10**6]),
    "stop": (["e", ["a", "b"], []], [[""], 5, [1]]),
    "stop_token_ids": ([[3]], [[-1], [VOCAB], [10**12], "x"]),
    "logprobs": ([0, 2, -1], [-2, 50, "x"]),
    "prompt_logprobs": ([0, 1], [-3, 21]),
    "logit_bias": ([{"5": 1.5}], [{"x": 1}, {"5": "a"}, [1], {str(VOCAB): 1}]),
    "allowed_token_ids": ([[5, 6, 7]], [[], [-1], [10**6]]),
    "bad_words": ([["fox"]], [[""], 3]),
    "logprobs_mode": (["processed_logprobs", "raw_logits"], ["nope", 1]),
    "ignore_eos": ([True, False], ["yes", 0.5]),
}
GARBAGE_JSON = ["{not json", "[1, 2]", "123", '"text"', "", "{", '{"n": 1,}', "\x00",
                '{"temperature": 1e999}', '{"n": 1e400}', '{"seed": -Infinity}']
UNICODE = ["\x00", "\ufeff", "e\u0301", "\u200b\u200d", "שלום עולם", "👩\u200d👩\u200d👧",
           "\U0010ffff", "中文字", "\t\n\r", "a\u0000b", "\ud7ff", "𝔘𝔫𝔦"]
WORDS = "the quick brown fox jumps over lazy dog".split()


@dataclass
class Row:
    """One drawn input row and what must become of it."""

    id: str | None
    prompt: Any = None  # a text, or invalid UTF-8 bytes (written as a string column)
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    params: str | None = None  # JSON text of the params column
    extra: dict[str, Any] = field(default_factory=dict)
    errors: list[list[str]] = field(default_factory=list)  # each: words one error must contain
    n: int = 1

    @property
    def bad(self) -> bool:
        return bool(self.errors)


@st.composite
def params_text(draw, row: Row) -> str | None:
    kind = draw(st.sampled_from(["none", "fields", "fields", "fields", "garbage", "random"]))
    if kind == "none":
        return None
    if kind == "garbage":
        row.errors.append(["sampling_params"])
        return draw(st.sampled_from(GARBAGE_JSON))
    if kind == "random":
        text = draw(st.text(max_size=12))
        try:
            value = json.loads(text)
        except ValueError:
            value = "invalid"
        assume(value is None or not isinstance(value, dict))  # "{}" is rare anyway
        if value is not None:
            row.errors.append(["sampling_params"])
        return text
    names = draw(st.lists(st.sampled_from(sorted(PARAMS)), max_size=3, unique=True))
    data: dict[str, Any] = {}
    refused: list[str] = []
    for name in names:
        good, bad = PARAMS[name]
        if draw(st.booleans()):
            data[name] = draw(st.sampled_from(bad))
            refused.append(f"sampling_params.{name}")
        else:
            data[name] = draw(st.sampled_from(good))
    if draw(st.integers(0, 5)) == 0:
        unknown = draw(st.one_of(st.sampled_from(["tempature", "best_of", "maxTokens"]),
                                 st.text(min_size=1, max_size=8)))
        assume(unknown not in FIELD_NAMES or unknown == "best_of")
        data[unknown] = draw(st.sampled_from([1, "x", None, NAN]))
        if data[unknown] is not None:  # null means "not set", whatever the name
            refused.append(f"sampling_params.{unknown}" if unknown == "best_of"
                           else f"unknown field {unknown!r}")
    if refused:
        row.errors.extend([name] for name in refused)
    elif isinstance(data.get("n"), int):
        row.n = data["n"]
    return json.dumps(data)  # NaN/Infinity become the JSON extensions Python reads back


def _text(draw) -> str:
    kind = draw(st.sampled_from(["words", "unicode", "random"]))
    if kind == "words":
        return " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6)))
    if kind == "unicode":
        return "".join(draw(st.lists(st.sampled_from(UNICODE), min_size=1, max_size=3)))
    return draw(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1,
                        max_size=10))


@st.composite
def rows(draw, tokenizer) -> list[Row]:
    """1-7 rows with unique ids (or a null id), one prompt each (or none), params."""
    out = []
    for i in range(draw(st.integers(1, 7))):
        row = Row(id=None if draw(st.integers(0, 12)) == 0 else f"row-{i}")
        if row.id is None:
            row.errors.append(["id: ", "column is null"])
        kind = draw(st.sampled_from(["text", "text", "tokens", "messages", "empty", "long",
                                     "none", "bad_utf8"]))
        if kind == "text":
            row.prompt = _text(draw)
            if len(tokenizer.encode(row.prompt)) >= MAX_MODEL_LEN:
                row.errors.append(["prompt: ", "leave no room"])
        elif kind == "tokens":
            row.token_ids = draw(st.lists(st.one_of(st.integers(0, VOCAB - 1),
                                                    st.integers(-2**62, 2**62)), max_size=6))
            if not row.token_ids or not all(0 <= t < VOCAB for t in row.token_ids):
                row.errors.append(["prompt: "])
        elif kind == "messages":
            content = draw(st.one_of(st.none(), st.just(""), st.just("hi there"),
                                     st.sampled_from(UNICODE)))
            role = draw(st.sampled_from(["user", "user", "system", None]))
            row.messages = draw(st.sampled_from([[], [{"role": role, "content": content}]]))
            if not row.messages:
                row.errors.append(["messages: ", "no messages"])
            elif role is None:
                row.errors.append(["messages: ", "role"])
            elif content is None:  # a chat message says something: no content is a row error
                row.errors.append(["messages: ", "has no content"])
            else:
                message = {k: v for k, v in row.messages[0].items() if v is not None}
                text = tokenizer.apply_chat_template([message], add_generation_prompt=True,
                                                     tokenize=False)
                if len(tokenizer.encode(text, add_special_tokens=False)) >= MAX_MODEL_LEN:
                    row.errors.append(["prompt: "])
        elif kind == "empty":
            row.prompt = ""
            row.errors.append(["prompt: is empty"])
        elif kind == "long":
            row.prompt = " ".join(["fox"] * 100)
            row.errors.append(["prompt: ", "leave no room"])
        elif kind == "bad_utf8":
            row.prompt = draw(st.sampled_from([b"\xff\xfe", b"ok\xc3", b"\xed\xa0\x80"]))
            row.errors.append(["prompt", "UTF-8"])
        else:
            row.errors.append(["no prompt"])
        row.params = draw(params_text(row))
        if draw(st.booleans()):
            row.extra = {"score": draw(st.one_of(st.none(), st.floats(allow_nan=True))),
                         "note": draw(st.one_of(st.none(), st.text(
                             st.characters(blacklist_categories=("Cs",)), max_size=5)))}
        out.append(row)
    return out


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
