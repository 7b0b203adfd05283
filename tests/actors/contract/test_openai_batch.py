"""OpenAI Batch lines: ``body.response_format`` mapped to ``structured_outputs`` (json_schema,
json_object, text), and each malformed or conflicting one an error naming the field."""

from __future__ import annotations

import json

import pytest

from actors.contract.openai_batch import CHAT, COMPLETIONS, parse_line
from sampler.params import SamplingParams

COLUMNS = {"prompt": "prompt", "messages": "messages", "token_ids": "prompt_token_ids",
           "params": "sampling_params"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _parse(body, url=CHAT):
    line = json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body})
    return parse_line(line, COLUMNS)


def _row(response_format=None, url=CHAT, **body):
    if response_format is not None:
        body["response_format"] = response_format
    if url == CHAT:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    return _parse(body, url)


def _params(row):
    assert row["request_error"] is None, row["request_error"]
    return json.loads(row["sampling_params"])


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_json_schema_becomes_a_json_constraint(url):
    row = _row({"type": "json_schema", "json_schema": {
        "name": "thing", "description": "a thing", "schema": SCHEMA, "strict": True}},
        url=url, max_tokens=5)
    params = _params(row)
    assert params == {"max_tokens": 5, "structured_outputs": {"json": SCHEMA}}
    loaded = SamplingParams.from_dict(params).structured_outputs
    assert (loaded.kind, loaded.json) == ("json", SCHEMA)


def test_strict_false_or_no_name_still_constrains():
    for spec in ({"schema": SCHEMA, "strict": False}, {"schema": SCHEMA}):
        params = _params(_row({"type": "json_schema", "json_schema": spec}))
        assert params["structured_outputs"] == {"json": SCHEMA}


def test_json_object_and_text():
    params = _params(_row({"type": "json_object"}))
    assert params == {"structured_outputs": {"json_object": True}}
    assert SamplingParams.from_dict(params).structured_outputs.kind == "json_object"
    assert _params(_row({"type": "text"}, temperature=0)) == {"temperature": 0}
    assert _params(_parse({"prompt": "x", "response_format": None}, COMPLETIONS)) == {}


def test_text_leaves_the_bodys_own_structured_outputs():
    params = _params(_row({"type": "text"}, structured_outputs={"choice": ["a", "b"]}))
    assert params == {"structured_outputs": {"choice": ["a", "b"]}}


@pytest.mark.parametrize("response_format,error", [
    ("json", "body.response_format: must be an object with a type, got 'json'"),
    ([{"type": "json_object"}], "body.response_format: must be an object with a type, got "
                               "[{'type': 'json_object'}]"),
    ({}, "body.response_format.type: must be one of text, json_object, json_schema, got None"),
    ({"type": "xml"}, "body.response_format.type: must be one of text, json_object, "
                      "json_schema, got 'xml'"),
    ({"type": "structural_tag", "structural_tag": {}},
     "body.response_format.structural_tag: unknown field"),
    ({"type": "json_schema"}, "body.response_format.json_schema: must be an object with a "
                              "schema"),
    ({"type": "json_schema", "json_schema": {"name": "n"}},
     "body.response_format.json_schema.schema: must be a JSON schema object, got None"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}},
     "body.response_format.json_schema.schema: must be a JSON schema object, got '{}'"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}},
     "body.response_format.json_schema.strict: must be a boolean, got 'yes'"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": 3}},
     "body.response_format.json_schema.name: must be a string, got 3"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "format": "x"}},
     "body.response_format.json_schema.format: unknown field"),
    ({"type": "json_object", "json_schema": {"schema": SCHEMA}},
     "body.response_format.json_schema: only with type json_schema, the type is 'json_object'"),
])
def test_a_bad_response_format_is_the_rows_error(response_format, error):
    row = _row(response_format)
    assert row["request_error"] == error
    assert row["custom_id"] == "c" and row["sampling_params"] is None


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}])
def test_response_format_with_structured_outputs_is_an_error(response_format):
    messages = [{"role": "user", "content": "x"}]
    for body in ({"messages": messages, "structured_outputs": {"regex": "a+"},
                  "response_format": response_format},
                 {"messages": messages, "response_format": response_format,
                  "structured_outputs": {"regex": "a+"}}):  # either field first
        assert _parse(body)["request_error"] == (
            "body.response_format: cannot be combined with body.structured_outputs (give one "
            "constraint)")
