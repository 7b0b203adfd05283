"""One field of ``SamplingParams`` read from a value of any source (Python, numpy scalars,
JSON, Arrow rows): the value as the field's type, or a ``ValueError`` naming the field
(``sampling_params.<name>``), the rule and the value."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def field_error(name: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"sampling_params.{name}: {rule}, got {value!r}")


def as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise field_error(name, "must be an integer", value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return as_int(name, value.item())
    raise field_error(name, "must be an integer", value)


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if type(value).__module__ == "numpy" and hasattr(value, "item"):
            return as_float(name, value.item())
        raise field_error(name, "must be a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise field_error(name, "must be finite", value)
    return value


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return as_bool(name, value.item())
    raise field_error(name, "must be true or false", value)


def as_int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise field_error(name, "must be a list of integers", value)
    out = [as_int(name, v) for v in value]
    for v in out:
        if v < 0:
            raise field_error(name, "token ids must be >= 0", v)
    return out


def as_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise field_error(name, "must be a string or a list of strings", value)
    out = list(value)
    for v in out:
        if not isinstance(v, str) or not v:
            raise field_error(name, "every entry must be a non-empty string", v)
    return out


def check_logprobs(name: str, value: Any) -> int | None:
    if value is None:
        return None
    value = as_int(name, value)
    if value < -1:
        raise field_error(name, "must be None, -1 (whole vocab) or >= 0", value)
    return value
