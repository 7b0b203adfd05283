"""A ``StructuredOutputsParams`` as the grammar text llguidance compiles (its Lark dialect).

Where llguidance reads a constraint more loosely than the strict definitions the output is
held to (docs/structured_outputs.md), the text is rewritten here: a regex's ``\\d \\D \\w
\\W \\s \\S`` become the exact code-point sets Python's ``re`` gives them (llguidance's
``\\w`` admits combining marks, its ``\\S`` the separators U+001C-U+001F, its ``\\W``
superscript digits), and ``^``/``$`` around the whole pattern are dropped (the text always
matches in full). JSON needs no rewrite: llguidance already refuses raw control characters,
lone surrogates and top-level arrays for ``{"type": "object"}``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from sampler.structured_params import StructuredOutputsParams

MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_CLASSES = "dDwWsS"


def to_lark(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a validated constraint (validity checked by the compiler).

    Example:
        >>> to_lark(StructuredOutputsParams(choice=["yes", "no"]))
        'start: "yes" | "no"'
    """
    import llguidance

    kind = so.kind
    if kind == "json_object":
        return json_object_lark(so)
    if kind == "json":
        schema = so.json
        if so.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options(so))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(python_regex(so.regex))
    if kind == "choice":
        return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
    text = so.grammar
    if "::=" in text:  # GBNF (llama.cpp / xgrammar grammars)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def json_options(so: StructuredOutputsParams) -> dict[str, Any]:
    """llguidance's JSON options: free whitespace (vLLM's default), none
    (``disable_any_whitespace``) or the ``whitespace_pattern``."""
    if so.whitespace_pattern is not None:
        return {"whitespace_pattern": so.whitespace_pattern, "whitespace_flexible": False}
    if so.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": True}


# any JSON object (RFC 8259), with numbers that stay finite as IEEE doubles (at most 16
# integer digits, a two-digit exponent) and no escape that decodes to a lone surrogate
_ESCAPE = r'\\(["\\\/bfnrt]|u([0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
_JSON_OBJECT = "\n".join([
    "start: object",
    '?value: object | array | STRING | NUMBER | "true" | "false" | "null"',
    'object: "{" [pair ("," pair)*] "}"',
    'pair: STRING ":" value',
    'array: "[" [value ("," value)*] "]"',
    "STRING: /\"(" + _ESCAPE + r'|[^"\\\x00-\x1F])*"/',
    r"NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/",
]) + "\n"


def json_object_lark(so: StructuredOutputsParams) -> str:
    """The grammar of ``json_object``: one JSON object at the top level (never an array),
    whitespace as :func:`json_options` says."""
    if so.whitespace_pattern is not None:
        space = so.whitespace_pattern
    else:
        space = "" if so.disable_any_whitespace else r"[ \t\n\r]+"
    text = _JSON_OBJECT + (f"%ignore /{space}/\n" if space else "")
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def _no_additional_properties(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema that does not set it."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and \
            "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# ---------------------------------------------------------------------- regex classes
@functools.lru_cache(maxsize=None)
def class_ranges(letter: str, ascii_only: bool = False) -> tuple[tuple[int, int], ...]:
    """The code points Python's ``re`` matches with ``\\<letter>`` (d, D, w, W, s, S), as
    sorted inclusive ranges, surrogates excluded (no text can hold them)."""
    flags = re.ASCII if ascii_only else 0
    match = re.compile("\\" + letter, flags).fullmatch
    ranges: list[tuple[int, int]] = []
    start = None
    for cp in range(MAX_CODE_POINT + 2):
        inside = (cp <= MAX_CODE_POINT and not _SURROGATES[0] <= cp <= _SURROGATES[1]
                  and match(chr(cp)) is not None)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return tuple(ranges)


def _ranges_text(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}"
                   for lo, hi in ranges)


def python_regex(pattern: str) -> str:
    """``pattern`` (Python ``re`` syntax) with its class escapes spelled as Python reads
    them, in the syntax llguidance's regex engine parses; a leading ``^`` and a trailing
    ``$`` are dropped. Anything else passes as it is (a construct llguidance lacks, such
    as a lookaround or ``\\b``, is the row's compile error)."""
    ascii_only = bool(re.compile(pattern).flags & re.ASCII)
    if ascii_only:
        pattern = re.sub(r"\(\?([a-zA-Z]*)a([a-zA-Z]*)\)",
                         lambda m: f"(?{m[1]}{m[2]})" if m[1] + m[2] else "", pattern)
    out: list[str] = []
    in_class = False
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            if nxt in _CLASSES:
                text = _ranges_text(class_ranges(nxt, ascii_only))
                out.append(text if in_class else f"[{text}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append(c)
        elif c == "[":
            in_class = True
            out.append(c)
            # a ']' right after '[' or '[^' is a literal
            j = i + 1
            if j < n and pattern[j] == "^":
                out.append("^")
                j += 1
            if j < n and pattern[j] == "]":
                out.append("\\]")
                j += 1
            i = j
            continue
        else:
            out.append(c)
        i += 1
    text = "".join(out)
    if text.startswith("^"):
        text = text[1:]
    if text.endswith("$") and not text.endswith("\\$"):
        text = text[:-1]
    return text

