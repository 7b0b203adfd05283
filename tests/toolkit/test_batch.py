"""OpenAI Batch files: lines mapped to rows, ``raygen run-batch`` end to end on the tiny model
(chat through the chat template, completions, n > 1, logprobs, malformed lines), resumable;
``response_format`` lines as a job: json_schema text valid under the schema, json_object text an
object, a bad or conflicting one the row's error."""

from __future__ import annotations

import json

import pytest

from actors.contract.openai_batch import CHAT, COMPLETIONS, parse_line
from toolkit.cli import main

COLUMNS = {"prompt": "prompt", "messages": "messages", "token_ids": "prompt_token_ids",
           "params": "sampling_params"}


def _line(custom_id, url, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_body_fields_map_to_sampling_params():
    row = parse_line(_line("a", CHAT, model="m", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text",
                                                                      "text": "there"}]}],
        max_completion_tokens=7, temperature=0.5, top_p=0.9, n=2, seed=3, stop="x",
        presence_penalty=0.1, frequency_penalty=0.2, logit_bias={"5": -100},
        logprobs=True, top_logprobs=2, top_k=4), COLUMNS)
    assert row["request_error"] is None and row["custom_id"] == "a"
    assert row["messages"] == [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hi there"}]
    assert json.loads(row["sampling_params"]) == {
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "stop": "x",
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": {"5": -100},
        "logprobs": 2, "top_k": 4}
    text = parse_line(_line("b", COMPLETIONS, prompt="once", max_tokens=3, logprobs=1), COLUMNS)
    assert (text["prompt"], json.loads(text["sampling_params"])) == (
        "once", {"max_tokens": 3, "logprobs": 1})
    ids = parse_line(_line("c", COMPLETIONS, prompt=[5, 6, 7]), COLUMNS)
    assert ids["prompt_token_ids"] == [5, 6, 7] and ids["prompt"] is None


@pytest.mark.parametrize("line,error", [
    ("{not json", "line: not valid JSON"),
    ("[1, 2]", "line: not a JSON object"),
    (_line("u", CHAT, messages=[{"role": "user", "content": "x"}], tools=[]),
     "body.tools: unknown field"),
    (_line("e", "/v1/embeddings", input="x"), "url: must be /v1/chat/completions"),
    (_line("s", CHAT, messages=[{"role": "user", "content": "x"}], stream=True),
     "body.stream: True is not supported"),
    (_line("m", CHAT, messages=[{"role": "user"}]), "body.messages[0]: has no content"),
    (_line("p", COMPLETIONS, prompt=["a", "b"]), "body.prompt: one prompt per line"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "custom_id: missing"),
])
def test_a_line_that_cannot_run_says_why(line, error):
    assert parse_line(line, COLUMNS)["request_error"].startswith(error)


@pytest.fixture(scope="module")
def batch_run(ray_local, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    lines = [
        _line("chat-1", CHAT, model="tiny", messages=[{"role": "user", "content": "hello"}],
              max_tokens=4, temperature=0),
        _line("text-1", COMPLETIONS, prompt="the quick brown", max_tokens=3, logprobs=2,
              seed=1),
        "{this line is broken",
        _line("chat-n", CHAT, messages=[{"role": "user", "content": "say"}], n=2, seed=9,
              max_completion_tokens=5, logprobs=True, top_logprobs=2),
        _line("bad-value", CHAT, messages=[{"role": "user", "content": "x"}], temperature="hot"),
        _line("unknown", COMPLETIONS, prompt="x", best_of=3),
    ]
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["run-batch", "-i", str(root / "in.jsonl"), "-o", str(root / "out.jsonl"),
                 "--model", tiny_llama, "--num-gpus-per-actor", "0", "--no-progress",
                 "--set", "rows_per_shard=4", "--set", "engine.max_model_len=128"])
    out = [json.loads(t) for t in (root / "out.jsonl").read_text().splitlines()]
    return {"root": root, "code": code, "out": out, "by_id": {o["custom_id"]: o for o in out}}


def test_run_batch_writes_one_openai_line_per_input_line(batch_run, tiny_llama):
    from transformers import AutoTokenizer

    assert batch_run["code"] == 0
    out, by_id = batch_run["out"], batch_run["by_id"]
    assert [o["custom_id"] for o in out] == ["chat-1", "text-1", None, "chat-n", "bad-value",
                                             "unknown"]
    assert [o["id"] for o in out] == [f"batch_req_{i}" for i in range(6)]
    assert all(o["error"] is None for o in out)
    chat = by_id["chat-1"]["response"]
    assert chat["status_code"] == 200 and chat["request_id"] == "req_0"
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["model"] == tiny_llama
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"],
                                                                   str)
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    templated = tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                        add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tok.encode(templated, add_special_tokens=False))
    assert body["usage"]["prompt_tokens"] == prompt_tokens  # through the chat template
    assert body["usage"]["total_tokens"] == prompt_tokens + body["usage"]["completion_tokens"]
    assert 1 <= body["usage"]["completion_tokens"] <= 4

    text = by_id["text-1"]["response"]["body"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"] is not None
    logprobs = text["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == \
        text["usage"]["completion_tokens"]
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])


def test_n_samples_and_chat_logprobs(batch_run):
    body = batch_run["by_id"]["chat-n"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["content"]) for c in body["choices"])
    for c in body["choices"]:
        for step in c["logprobs"]["content"]:
            assert step["logprob"] <= 0 and len(step["top_logprobs"]) == 2
            assert step["bytes"] == list(step["token"].encode("utf-8", "replace"))


def test_malformed_lines_get_an_error_and_the_others_run(batch_run):
    out = batch_run["out"]
    assert [o["response"]["status_code"] for o in out] == [200, 200, 400, 200, 400, 400]
    errors = {o["id"]: o["response"]["body"]["error"]["message"] for o in out
              if o["response"]["status_code"] == 400}
    assert errors["batch_req_2"].startswith("line: not valid JSON")
    assert errors["batch_req_4"].startswith("sampling_params.temperature")
    assert errors["batch_req_5"] == "body.best_of: 3 is not supported by batch runs"
    assert not (batch_run["root"] / "out.jsonl.raygen").exists()  # the work directory is gone


def test_an_openai_batch_file_is_a_job_input_format(batch_run, tiny_llama):
    from jobs.runner import run_job
    from tests.jobs.helpers import read_output

    root = batch_run["root"]
    result = run_job({"model": tiny_llama, "input": str(root / "in.jsonl"),
                      "output": str(root / "job"), "input_format": "openai_batch",
                      "num_gpus_per_actor": 0, "engine": {"max_model_len": 128}},
                     progress=False)
    assert result.input_rows == 6 and result.errors == 3
    table = read_output(root / "job")
    assert {"custom_id", "endpoint", "messages", "prompt"} <= set(table.column_names)
    assert "request_error" not in table.column_names
    rows = {r["custom_id"]: r for r in table.to_pylist()}
    assert rows["chat-1"]["messages"] == [{"role": "user", "content": "hello"}]
    greedy = batch_run["by_id"]["chat-1"]["response"]["body"]["choices"][0]["message"]
    assert rows["chat-1"]["output_text"] == greedy["content"]  # the same row as run-batch's


PAIR_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.ray
def test_response_format_lines_constrain_their_text(ray_local, tiny_llama, tmp_path):
    from jobs.runner import run_job
    from tests.actors.engine.structured_checks import check_schema, strict_json
    from tests.jobs.helpers import read_output

    chat = [{"role": "user", "content": "give json"}]
    schema = {"type": "json_schema", "json_schema": {"name": "pair", "schema": PAIR_SCHEMA,
                                                     "strict": True}}
    lines = [_line(f"schema-{i}", CHAT, messages=chat, response_format=schema, seed=i,
                   max_tokens=120) for i in range(4)]
    lines += [_line(f"object-{i}", COMPLETIONS, prompt="data:", seed=i, max_tokens=160,
                    response_format={"type": "json_object"}) for i in range(10)]
    lines += [_line("bad", CHAT, messages=chat, response_format={"type": "xml"}),
              _line("both", CHAT, messages=chat, response_format={"type": "json_object"},
                    structured_outputs={"regex": "a+"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = run_job({"model": tiny_llama, "input": str(tmp_path / "in.jsonl"),
                      "output": str(tmp_path / "out"), "input_format": "openai_batch",
                      "num_gpus_per_actor": 0, "rows_per_shard": 16,
                      "engine": {"max_model_len": 192}}, progress=False)
    assert result.errors == 2
    rows = {r["custom_id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows["bad"]["error"] == ("row id '14' (shard 0): body.response_format.type: must be "
                                    "one of text, json_object, json_schema, got 'xml'")
    assert rows["both"]["error"] == ("row id '15' (shard 0): body.response_format: cannot be "
                                     "combined with body.structured_outputs (give one "
                                     "constraint)")
    stopped = {"schema": 0, "object": 0}
    for custom_id, row in rows.items():
        kind = custom_id.split("-")[0]
        if kind not in stopped:
            continue
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert row["output_text"].startswith("{")
        if row["finish_reason"] == "stop":  # a whole value: valid
            stopped[kind] += 1
            if kind == "schema":
                check_schema(row["output_text"], PAIR_SCHEMA)
            else:
                assert isinstance(strict_json(row["output_text"]), dict)
    assert stopped["schema"] >= 3 and stopped["object"] >= 2, stopped
