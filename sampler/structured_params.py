"""StructuredOutputsParams: the constraint a request's text must follow (vLLM's field names).

Exactly one kind per request: ``json`` (a JSON schema, dict or JSON text), ``regex`` (a
Python ``re`` pattern, matched in full), ``choice`` (one of the given strings), ``grammar``
(Lark, or GBNF when it contains ``::=``) or ``json_object`` (any JSON object). Every
violation raises ``ValueError`` naming ``sampling_params.structured_outputs.<field>``.
Compiling the constraint happens in the engine (``actors.engine.structured``); this module only
validates and normalises, and loads nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")
_UNSUPPORTED = {"structural_tag": "structural tags are not supported"}
_PREFIX = "sampling_params.structured_outputs"


def _fail(name: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"{_PREFIX}.{name}: {rule}, got {value!r:.200}")


@dataclass(slots=True)
class StructuredOutputsParams:
    """The constraint of one request's output text.

    Args:
        json: a JSON schema (dict or JSON text); the text is a JSON value valid under it.
        regex: a pattern the whole text matches (``re.fullmatch``).
        choice: the text is exactly one of these strings.
        grammar: a Lark grammar (GBNF when it contains ``::=``); the text is in its language.
        json_object: True: the text is one JSON object (top level ``{...}``).
        whitespace_pattern: with ``json``/``json_object``, a regex for the whitespace between
            tokens (``""``: compact JSON, as ``disable_any_whitespace``).
        disable_any_whitespace: JSON without optional whitespace (``{"a":1}``).
        disable_additional_properties: object schemas that do not say otherwise get
            ``additionalProperties: false``.
        disable_fallback: accepted for vLLM compatibility (there is one backend: no effect).

    Example:
        >>> StructuredOutputsParams(choice=["yes", "no"]).kind
        'choice'
    """

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if not given:
            raise ValueError(f"{_PREFIX}: give exactly one of {', '.join(KINDS)}, got none")
        if len(given) > 1:
            raise ValueError(f"{_PREFIX}.{given[1]}: only one kind per request, "
                             f"{given[0]} is given too")
        if self.json is not None:
            self.json = _as_schema(self.json)
        if self.regex is not None:
            if not isinstance(self.regex, str):
                raise _fail("regex", "must be a string", self.regex)
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise _fail("regex", f"not a valid regular expression ({exc})",
                            self.regex) from None
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes, Mapping)) or not hasattr(self.choice,
                                                                            "__iter__"):
                raise _fail("choice", "must be a list of strings", self.choice)
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise _fail("choice", "must be a non-empty list of non-empty strings",
                            self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise _fail("grammar", "must be a non-empty string", self.grammar)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _fail("json_object", "must be true or false", self.json_object)
        for name in ("disable_any_whitespace", "disable_additional_properties",
                     "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "must be true or false", getattr(self, name))
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise _fail("whitespace_pattern", "must be a string", self.whitespace_pattern)
            if self.kind not in ("json", "json_object"):
                raise _fail("whitespace_pattern", "applies to json and json_object only",
                            self.whitespace_pattern)
            try:
                re.compile(self.whitespace_pattern)
            except re.error as exc:
                raise _fail("whitespace_pattern", f"not a valid regular expression ({exc})",
                            self.whitespace_pattern) from None

    @property
    def kind(self) -> str:
        """The one kind given: json, regex, choice, grammar or json_object."""
        return next(k for k in KINDS if getattr(self, k) is not None
                    and getattr(self, k) is not False)

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal keys compile to the same grammar."""
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams:
        """From a StructuredOutputsParams, a mapping (null fields: not given) or JSON text."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{_PREFIX}: not valid JSON ({exc})") from None
        if hasattr(value, "as_py") and callable(value.as_py):  # pyarrow scalar
            value = value.as_py()
        if not isinstance(value, Mapping):
            raise ValueError(f"{_PREFIX}: expected a mapping of field -> value, got "
                             f"{value!r:.200}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key in _UNSUPPORTED:
                raise ValueError(f"{_PREFIX}.{key}: {_UNSUPPORTED[key]}")
            if key not in names:
                raise ValueError(f"{_PREFIX}: unknown field {key!r} (known: "
                                 f"{', '.join(sorted(names))})")
        return cls(**{k: v for k, v in value.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, JSON-serialisable (``json`` as a dict)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value is not False:
                out[f.name] = list(value) if f.name == "choice" else value
        return out


def _as_schema(value: Any) -> Any:
    """A JSON schema from a dict (or bool) or its JSON text."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _fail("json", f"not valid JSON ({exc})", value) from None
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise _fail("json", "must be a JSON schema (an object, or its JSON text)", value)
    try:
        return json.loads(json.dumps(value))  # a private, plain copy
    except (TypeError, ValueError) as exc:
        raise _fail("json", f"must be JSON-serialisable ({exc})", value) from None
