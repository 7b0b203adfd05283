"""SamplingParams: defaults, validation rules (docs/sampler.md §1), construction helpers."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest

from sampler import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (
        None, 16, 0, None, None)
    assert p.logprobs_mode == "raw_logprobs" and p.stop == [] and p.detokenize


@pytest.mark.parametrize("field,value,rule", [
    ("n", 0, "must be >= 1"),
    ("temperature", -0.1, "must be >= 0"),
    ("temperature", math.inf, "must be finite"),
    ("top_p", 0.0, "must be in (0, 1]"),
    ("top_p", 1.01, "must be in (0, 1]"),
    ("top_k", -2, "must be -1, 0 (off) or >= 1"),
    ("min_p", -0.1, "must be in [0, 1]"),
    ("min_p", 1.5, "must be in [0, 1]"),
    ("presence_penalty", 2.1, "must be in [-2, 2]"),
    ("frequency_penalty", -2.5, "must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "must be > 0"),
    ("seed", -2, f"must be None, -1 or in [0, {2**63 - 1}]"),
    ("seed", 2**63, f"must be None, -1 or in [0, {2**63 - 1}]"),
    ("max_tokens", 0, "must be >= 1 or None"),
    ("min_tokens", -1, "must be >= 0"),
    ("stop", [""], "every entry must be a non-empty string"),
    ("stop_token_ids", [-1], "token ids must be >= 0"),
    ("logprobs", -2, "must be None, -1 (whole vocab) or >= 0"),
    ("prompt_logprobs", -3, "must be None, -1 (whole vocab) or >= 0"),
    ("logprobs_mode", "raw", "must be one of raw_logprobs, raw_logits, processed_logprobs, "
                             "processed_logits, temperature_logprobs"),
    ("logit_bias", {1: math.nan}, "must be finite"),
    ("logit_bias", {"x": 1.0}, "keys must be token ids"),
    ("allowed_token_ids", [], "must be None or a non-empty list"),
    ("bad_words", [""], "every entry must be a non-empty string"),
    ("ignore_eos", 1, "must be true or false"),
    ("n", 1.5, "must be an integer"),
])
def test_violations_name_the_field_and_the_bound(field, value, rule):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    # "sampling_params.<field>: <rule or bound>, got <the value given>"
    assert message.startswith(f"sampling_params.{field}: {rule}, got "), message


def test_normalisations():
    assert SamplingParams(temperature=0.001).temperature == 0.01
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(stop_token_ids=[5, 3, 5]).stop_token_ids == [5, 3]
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)


def test_rejects_best_of_and_unknown_fields():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(ValueError, match="unknown field 'temprature'"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_from_dict_json_and_arrow_merge_field_by_field():
    defaults = SamplingParams(temperature=0.5, max_tokens=32, seed=3)
    p = SamplingParams.from_dict({"top_k": 5, "seed": None}, defaults=defaults)
    assert (p.temperature, p.top_k, p.max_tokens, p.seed) == (0.5, 5, 32, 3)
    assert SamplingParams.from_json(json.dumps({"top_p": 0.5}), defaults=defaults).top_p == 0.5
    table = pa.table({"sp": [{"temperature": 0.0, "logprobs": 2}, {"temperature": None,
                                                                   "logprobs": None}]})
    rows = [SamplingParams.coerce(table["sp"][i], defaults=defaults) for i in range(2)]
    assert rows[0].temperature == 0.0 and rows[0].logprobs == 2
    assert rows[1].temperature == 0.5 and rows[1].logprobs is None
    assert SamplingParams.coerce('{"n": 2}').n == 2
    assert SamplingParams.coerce(None, defaults=defaults) == defaults
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.coerce(3)
    with pytest.raises(ValueError, match="JSON"):
        SamplingParams.from_json("{nope")


def test_roundtrip_and_replace():
    p = SamplingParams(logit_bias={3: 1.0}, bad_words=["x"], allowed_token_ids=[1, 2], seed=4)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert json.loads(json.dumps(p.to_dict()))["seed"] == 4
    assert p.replace(top_k=3).top_k == 3
    with pytest.raises(ValueError, match="top_k"):
        p.replace(top_k=-5)


def test_verify_for_model():
    SamplingParams(stop_token_ids=[9], logprobs=20).verify_for_model(10, max_logprobs=20)
    for kwargs, name in [({"stop_token_ids": [10]}, "stop_token_ids"),
                         ({"allowed_token_ids": [10]}, "allowed_token_ids"),
                         ({"logit_bias": {10: 1.0}}, "logit_bias"),
                         ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": 30}, "prompt_logprobs")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs).verify_for_model(10, max_logprobs=20)
    SamplingParams(logprobs=-1).verify_for_model(10, max_logprobs=20)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=9, max_tokens=None).verify_for_model(10, max_model_len=8)
