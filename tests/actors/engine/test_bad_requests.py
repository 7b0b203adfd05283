"""A bad request fails alone, with an error that says why; the others are unaffected."""

from __future__ import annotations

import re

import numpy as np

from sampler import SamplingParams
from tests.actors.helpers import by_id, make_engine

GOOD = SamplingParams(temperature=0.8, max_tokens=6, seed=3)

BAD = [
    ("too_long", list(range(5, 305)), GOOD, r"300 tokens leave no room.*max_model_len=256"),
    ("empty_text", "", GOOD, r"prompt: is empty"),
    ("empty_ids", [], GOOD, r"prompt: is empty"),
    ("out_of_vocab", [5, 6, 100000], GOOD, r"token ids must be in \[0, 512\)"),
    ("negative_id", [5, -3], GOOD, r"token ids must be in \[0, 512\)"),
    ("not_int_ids", [5, 2.5], GOOD, r"token ids must be integers"),
    ("wrong_type", 12345, GOOD, r"expected a string, a list of token ids"),
    ("bad_temperature", [5, 6], {"temperature": -1}, r"sampling_params.temperature"),
    ("unknown_field", [5, 6], {"nucleus": 0.9}, r"unknown field 'nucleus'"),
    ("best_of", [5, 6], {"best_of": 2}, r"best_of"),
    ("too_many_samples", [5, 6], {"n": 9}, r"max_num_seqs \(8\)"),
    ("too_many_logprobs", [5, 6], {"logprobs": 21}, r"max_logprobs \(20\)"),
    ("stop_id_out_of_vocab", [5, 6], {"stop_token_ids": [600]}, r"vocab size 512"),
    ("bias_out_of_vocab", [5, 6], {"logit_bias": {9999: 1.0}}, r"vocab size 512"),
    ("params_not_json", [5, 6], "{not json", r"not valid JSON"),
    ("bool_id", [5, True], GOOD, r"token ids must be integers, got True"),
    ("bool_array", np.array([True, False]), GOOD, r"token ids must be integers"),
    ("float_array", np.array([5.0, 6.0]), GOOD, r"token ids must be integers"),
    ("array_out_of_vocab", np.array([5, 512], np.int64), GOOD, r"must be in \[0, 512\)"),
]


def test_bad_requests_fail_only_themselves(tiny_llama):
    engine = make_engine(tiny_llama)
    good = [("g0", [5, 6, 7], GOOD), ("g1", "Hello there", GOOD.replace(n=2)),
            ("g2", [{"role": "user", "content": "hi"}], GOOD)]
    mixed = [(rid, prompt, params) for rid, prompt, params, _ in BAD]
    mixed[1:1], mixed[6:6], mixed[12:12] = [good[0]], [good[1]], [good[2]]
    outs = by_id(engine.generate(mixed))
    for rid, _, _, message in BAD:
        out = outs[(rid, 0)]
        assert out.finish_reason == "error", rid
        assert re.search(message, out.error), (rid, out.error)
        assert out.output_token_ids == [] and out.output_text is None
    assert outs[("too_many_samples", 0)].seed is not None  # unseeded: derived and reported
    clean = by_id(make_engine(tiny_llama).generate(good))
    for key, out in clean.items():
        assert outs[key].error is None and outs[key].finish_reason == "length"
        assert outs[key].output_token_ids == out.output_token_ids
    assert not engine.has_unfinished_requests()


def test_add_request_never_raises_and_errors_come_from_step(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("bad", [], SamplingParams(n=3))
    engine.add_request("dup", [5, 6], GOOD)
    engine.add_request("dup", [5, 6], GOOD)
    engine.add_request(["unhashable"], [5, 6], GOOD)
    first = engine.step()
    assert [(o.id, o.sample_index, o.finish_reason) for o in first] == [
        ("bad", 0, "error"), ("bad", 1, "error"), ("bad", 2, "error"), ("dup", 0, "error"),
        (["unhashable"], 0, "error")]
    assert "already running" in first[3].error and "not hashable" in first[4].error
    rest = []
    while engine.has_unfinished_requests():
        rest += engine.step()
    assert [(o.id, o.finish_reason) for o in rest] == [("dup", "length")]


def test_token_id_prompts_of_any_sequence_type_run_alike(tiny_llama):
    ids = [5, 6, 7, 300]
    prompts = {"list": ids, "tuple": tuple(ids), "int64": np.array(ids, np.int64),
               "int32": np.array(ids, np.int32), "numpy_scalars": [np.int64(t) for t in ids]}
    outs = by_id(make_engine(tiny_llama).generate(
        [(name, prompt, GOOD) for name, prompt in prompts.items()]))
    expected = outs[("list", 0)].output_token_ids
    assert len(expected) == GOOD.max_tokens
    for name in prompts:
        assert outs[(name, 0)].error is None, (name, outs[(name, 0)].error)
        assert outs[(name, 0)].num_prompt_tokens == len(ids)
        assert outs[(name, 0)].output_token_ids == expected, name
