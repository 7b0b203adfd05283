"""OpenAI Batch input files (``vllm run-batch``, the OpenAI and Azure Batch APIs) as job rows.

Each line ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`` becomes one row: ``custom_id``, ``endpoint`` (the url), the prompt (chat
``messages``, a completion ``prompt`` text or token ids), ``sampling_params`` (JSON text: the
body's OpenAI fields mapped to SamplingParams; ``response_format`` json_schema / json_object
becomes ``structured_outputs``) and ``request_error``: why the line cannot run (not JSON, an
unknown endpoint or body field, a bad value), which makes that row an error row while the other
lines run. The row's id is its line's index in the file (from 0).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from actors.contract.jsonl import lines
from sampler.params import FIELD_NAMES

FORMAT = "openai-batch"  # the format name a plan records for such a file
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ERROR_COLUMN = "request_error"
_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_CHUNK = 4096
# OpenAI body fields -> SamplingParams fields (None: accepted, not a sampling parameter)
_RENAMED = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
            "temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
            "stop": "stop", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
            "model": None, "user": None, "messages": None, "prompt": None}
_RESPONSE_TYPES = ("text", "json_object", "json_schema")  # response_format.type
_UNSUPPORTED = {"stream": False, "echo": False, "best_of": 1, "suffix": None}  # allowed value


def schema(columns: dict[str, str]) -> pa.Schema:
    """The rows' schema, the prompt and params columns named as the job names them."""
    return pa.schema([
        ("custom_id", pa.string()), ("endpoint", pa.string()),
        (columns.get("prompt", "prompt"), pa.string()),
        (columns.get("messages", "messages"), pa.list_(_MESSAGE)),
        (columns.get("token_ids", "prompt_token_ids"), pa.list_(pa.int64())),
        (columns.get("params", "sampling_params"), pa.string()),
        (ERROR_COLUMN, pa.string()),
    ])


def _text_content(content: Any, k: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones can be run here
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"body.messages[{k}].content: only text parts are supported, "
                                 f"got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        raise ValueError(f"body.messages[{k}]: has no content")
    raise ValueError(f"body.messages[{k}].content: must be a string or a list of text "
                     f"parts, got {type(content).__name__}")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages: must be a non-empty list of messages")
    out = []
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"body.messages[{k}]: must be an object")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"body.messages[{k}]: has no role")
        out.append({"role": message["role"], "content": _text_content(message.get("content"),
                                                                      k)})
    return out


def _prompt(value: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt given as a list of one
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        return None, value
    if isinstance(value, list) and len(value) > 1:
        raise ValueError("body.prompt: one prompt per line (a list of several prompts is not "
                         "supported)")
    raise ValueError("body.prompt: must be a string or a list of token ids")


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` -> a ``structured_outputs`` mapping (None: no constraint)."""
    if not isinstance(value, dict):
        raise ValueError(f"body.response_format: must be an object with a type, got "
                         f"{value!r:.200}")
    for key in value:
        if key not in ("type", "json_schema"):
            raise ValueError(f"body.response_format.{key}: unknown field")
    kind = value.get("type")
    if kind not in _RESPONSE_TYPES:
        raise ValueError(f"body.response_format.type: must be one of "
                         f"{', '.join(_RESPONSE_TYPES)}, got {kind!r:.200}")
    if kind != "json_schema":
        if "json_schema" in value:
            raise ValueError(f"body.response_format.json_schema: only with type json_schema, "
                             f"the type is {kind!r}")
        return {"json_object": True} if kind == "json_object" else None
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("body.response_format.json_schema: must be an object with a schema")
    for key in spec:
        if key not in ("name", "description", "schema", "strict"):
            raise ValueError(f"body.response_format.json_schema.{key}: unknown field")
    if not isinstance(spec.get("schema"), dict):
        raise ValueError(f"body.response_format.json_schema.schema: must be a JSON schema "
                         f"object, got {spec.get('schema')!r:.200}")
    for key, rule in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], rule):
            raise ValueError(f"body.response_format.json_schema.{key}: must be a "
                             f"{'string' if rule is str else 'boolean'}, got {spec[key]!r:.200}")
    return {"json": spec["schema"]}  # always enforced, whatever strict says


def _params(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in _UNSUPPORTED:
            if value not in (None, _UNSUPPORTED[key]):
                raise ValueError(f"body.{key}: {value!r} is not supported by batch runs")
        elif key in _RENAMED:
            if _RENAMED[key] is not None and value is not None:
                params[_RENAMED[key]] = value
        elif key == "logprobs":
            if endpoint == CHAT:  # chat: a bool; the number of alternatives is top_logprobs
                if not isinstance(value, bool):
                    raise ValueError(f"body.logprobs: must be true or false, got {value!r}")
                if value:
                    params.setdefault("logprobs", 0)
            elif value is not None:
                params["logprobs"] = value
        elif key == "top_logprobs" and endpoint == CHAT:
            if value is not None:
                if not body.get("logprobs"):
                    raise ValueError("body.top_logprobs: needs logprobs: true")
                params["logprobs"] = value
        elif key == "response_format":
            if value is not None:
                constraint = _response_format(value)
                if constraint is not None:
                    if body.get("structured_outputs") is not None:
                        raise ValueError("body.response_format: cannot be combined with "
                                         "body.structured_outputs (give one constraint)")
                    params["structured_outputs"] = constraint
        elif key in FIELD_NAMES:  # vLLM's extra sampling fields (top_k, min_p, ...)
            params[key] = value
        else:
            raise ValueError(f"body.{key}: unknown field")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):  # OpenAI's keys are token ids as text
        try:
            params["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise ValueError("body.logit_bias: keys must be token ids") from None
    return params


def parse_line(text: str, columns: dict[str, str]) -> dict[str, Any]:
    """One line -> one row (``request_error`` set when the line cannot run)."""
    names = schema(columns).names
    row: dict[str, Any] = dict.fromkeys(names)
    try:
        data = json.loads(text)
    except ValueError as exc:
        row[ERROR_COLUMN] = f"line: not valid JSON ({exc})"
        return row
    if not isinstance(data, dict):
        row[ERROR_COLUMN] = "line: not a JSON object"
        return row
    custom_id = data.get("custom_id")
    row["custom_id"] = None if custom_id is None else str(custom_id)
    url = data.get("url")
    row["endpoint"] = url if isinstance(url, str) else None
    try:
        for key in data:
            if key not in ("custom_id", "method", "url", "body"):
                raise ValueError(f"{key}: unknown field of a batch line")
        if custom_id is None:
            raise ValueError("custom_id: missing")
        if data.get("method", "POST") != "POST":
            raise ValueError(f"method: must be POST, got {data.get('method')!r}")
        if url not in (CHAT, COMPLETIONS):
            raise ValueError(f"url: must be {CHAT} or {COMPLETIONS}, got {url!r}")
        body = data.get("body")
        if not isinstance(body, dict):
            raise ValueError("body: must be an object")
        if url == CHAT:
            row[names[3]] = _messages(body.get("messages"))
        else:
            if "prompt" not in body:
                raise ValueError("body.prompt: missing")
            row[names[2]], row[names[4]] = _prompt(body["prompt"])
        row[names[5]] = json.dumps(_params(body, url))
    except ValueError as exc:
        row[ERROR_COLUMN] = str(exc)
    return row


def _chunks(fs: pafs.FileSystem, path: str, columns: dict[str, str], start: int = 0,
            stop: int | None = None) -> Iterator[pa.Table]:
    rows: list[dict[str, Any]] = []
    target = schema(columns)
    for index, (_, text) in enumerate(lines(fs, path)):
        if stop is not None and index >= stop:
            break
        if index < start:
            continue
        rows.append(parse_line(text, columns))
        if len(rows) == _CHUNK:
            yield pa.Table.from_pylist(rows, schema=target)
            rows = []
    if rows:
        yield pa.Table.from_pylist(rows, schema=target)


def scan(fs: pafs.FileSystem, path: str, columns: dict[str, str]) -> tuple[pa.Schema, int]:
    """The rows' schema and the file's number of (non-blank) lines."""
    return schema(columns), sum(1 for _ in lines(fs, path))


def read_range(fs: pafs.FileSystem, path: str, columns: dict[str, str], start: int,
               stop: int) -> pa.Table:
    """Rows ``[start, stop)`` (row = non-blank line)."""
    chunks = list(_chunks(fs, path, columns, start, stop))
    return pa.concat_tables(chunks) if chunks else schema(columns).empty_table()
