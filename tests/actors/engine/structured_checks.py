"""Strict validity checks of constrained outputs, shared by the CPU and GPU tests."""

from __future__ import annotations

import json
import math
import re
from typing import Any

# an object with typed fields (strings with bounds, an integer range, a number, a boolean,
# an enum, a short array)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": -1000, "maximum": 1000},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "score", "ok", "kind", "tags"],
    "additionalProperties": False,
}
# sums and products of small integers, with parentheses (Lark)
ARITHMETIC_LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor ("*" factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
ARITHMETIC_GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor ("*" factor)*
factor ::= [0-9] [0-9]? [0-9]? | "(" expr ")"
"""
DATE_REGEX = r"\d{4}-[0-9]{2}-\d{2}(T\w{1,3})?"


def _no_constant(name: str) -> Any:
    raise ValueError(f"not RFC 8259 JSON: {name}")


def strict_json(text: str) -> Any:
    """The JSON value of ``text`` under RFC 8259: no NaN/Infinity, no raw control characters
    in strings (``json.loads`` is strict about them), nothing that decodes to U+FFFD, and
    no lone surrogate escapes. Raises ``ValueError`` otherwise."""
    if "\ufffd" in text:
        raise ValueError("the text holds bytes that are not UTF-8 (U+FFFD)")
    value = json.loads(text, parse_constant=_no_constant)
    _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    if isinstance(value, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise ValueError("a string holds a lone surrogate")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("a number outside the float range")
    elif isinstance(value, list):
        for v in value:
            _check_strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)


def check_schema(text: str, schema: dict) -> Any:
    """``text`` is strict JSON valid under ``schema`` (JSON Schema Draft 2020-12)."""
    import jsonschema

    value = strict_json(text)
    jsonschema.Draft202012Validator(schema).validate(value)
    return value


def is_arithmetic(text: str) -> bool:
    """Whether ``text`` is in the language of ``ARITHMETIC_LARK`` (recursive descent)."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(text) and text[pos] == "*":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[0-9]{1,3}", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    return expr() and pos == len(text)


def check_output(out, so: dict) -> None:
    """A finished (``stop``) constrained output's text obeys its constraint ``so``."""
    text = out.output_text
    if "json" in so:
        check_schema(text, so["json"])
    elif "json_object" in so:
        assert isinstance(strict_json(text), dict), text
    elif "regex" in so:
        assert re.fullmatch(so["regex"], text), text
    elif "choice" in so:
        assert text in so["choice"], text
    else:
        assert is_arithmetic(text), text


def compile_first(engine, requests) -> None:
    """Compiles the constraints of ``requests`` (``(id, prompt, params)``) on ``engine``
    before they run, so that no request is passed over while its constraint compiles: the
    steps' batches are then the same from run to run (on a GPU, a row's bf16 logits depend
    on the batch it is computed in)."""
    for _, _, params in requests:
        if params.structured_outputs is not None:
            engine.structured.submit(params.structured_outputs).result()
