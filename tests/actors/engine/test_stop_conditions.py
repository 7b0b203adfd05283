"""Each stop condition of docs/sampler.md §4 through the engine: max_tokens, EOS (and
ignore_eos), stop token ids, min_tokens, stop strings (split across tokens, truncated or
included), and the model length."""

from __future__ import annotations

import pytest

from sampler import SamplingParams
from tests.actors.helpers import make_engine

PROMPT = "Once upon a time there was a small robot"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, max_num_seqs=4)


@pytest.fixture(scope="module")
def greedy(engine):
    """The unconstrained greedy continuation: token ids and their text pieces."""
    out = engine.generate([(0, PROMPT, SamplingParams(temperature=0.0, max_tokens=40,
                                                      ignore_eos=True))])[0]
    tok = engine.tokenizer
    ids = out.output_token_ids
    texts = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    assert texts[-1] == out.output_text
    return ids, texts


def run(engine, **kw):
    return engine.generate([(0, PROMPT, SamplingParams(temperature=0.0, **kw))])[0]


def test_max_tokens(engine, greedy):
    out = run(engine, max_tokens=7, ignore_eos=True)
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.output_token_ids == greedy[0][:7] and out.num_output_tokens == 7


def test_eos_stops_after_min_tokens_and_ignore_eos(engine):
    eos = engine.tokenizer.eos_token_id
    out = run(engine, max_tokens=20, min_tokens=3, logit_bias={eos: 100.0})
    # as vLLM: an EOS token stops the row with no stop reason (a stop id or string has one)
    assert out.finish_reason == "stop" and out.stop_reason is None and out.stop_token_id is None
    assert out.num_output_tokens == 4 and out.output_token_ids[-1] == eos
    assert eos not in out.output_token_ids[:3]
    assert "<|im_end|>" not in out.output_text

    shown = run(engine, max_tokens=20, min_tokens=3, logit_bias={eos: 100.0},
                skip_special_tokens=False, include_stop_str_in_output=True)
    assert shown.output_text.endswith("<|im_end|>")
    hidden = run(engine, max_tokens=20, min_tokens=3, logit_bias={eos: 100.0},
                 skip_special_tokens=False)
    assert not hidden.output_text.endswith("<|im_end|>")

    ignored = run(engine, max_tokens=6, logit_bias={eos: 100.0}, ignore_eos=True)
    assert ignored.finish_reason == "length" and ignored.output_token_ids == [eos] * 6


def _first_new(ids: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` that does not occur before it."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k])


def test_stop_token_ids_and_min_tokens(engine, greedy):
    ids = greedy[0]
    k = _first_new(ids, 3)
    out = run(engine, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[k]])
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]  # the id, an int
    assert type(out.stop_reason) is int and out.stop_token_id == ids[k]
    assert out.to_dict()["stop_reason"] is None and out.to_dict()["stop_token_id"] == ids[k]
    assert out.output_token_ids == ids[:k + 1]

    late = run(engine, max_tokens=k + 8, ignore_eos=True, stop_token_ids=[ids[k]],
               min_tokens=k + 3)
    assert late.num_output_tokens >= k + 3
    assert ids[k] not in late.output_token_ids[:k + 3]  # masked until min_tokens
    assert late.finish_reason == "length" or late.output_token_ids[-1] == ids[k]


def _split_stop(ids, texts):
    """A 2-character stop string made of the last character of token i's text and the first
    of token i+1's, occurring first exactly at that boundary."""
    for i in range(1, len(ids) - 1):
        a = texts[i + 1][len(texts[i]):]
        b = texts[i + 2][len(texts[i + 1]):]
        if not a or not b or "\ufffd" in a + b:
            continue
        stop = a[-1] + b[0]
        at = len(texts[i + 1]) - 1
        if texts[-1].find(stop) == at:
            return i, stop, at
    raise AssertionError("no clean token boundary in the greedy text")


def test_stop_string_split_across_tokens(engine, greedy):
    ids, texts = greedy
    i, stop, at = _split_stop(ids, texts)
    full = texts[-1]
    out = run(engine, max_tokens=40, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.output_text == full[:at]
    assert out.output_token_ids == ids[:i + 2]  # finished by the token completing it

    kept = run(engine, max_tokens=40, ignore_eos=True, stop=[stop],
               include_stop_str_in_output=True)
    assert kept.output_text == full[:at + len(stop)]

    # of two stop strings, the one that occurs first wins
    later = full[at + 2:at + 5]
    assert later and full.find(later) > at
    both = run(engine, max_tokens=40, ignore_eos=True, stop=[later, stop])
    assert both.stop_reason == stop and both.output_text == full[:at]


def test_stop_string_not_before_min_tokens(engine, greedy):
    ids, texts = greedy
    i, stop, at = _split_stop(ids, texts)
    out = run(engine, max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=i + 5)
    assert out.num_output_tokens >= i + 5
    assert out.output_text.find(stop) == at  # seen too early: not a stop


def test_model_length(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=48)
    prompt = list(range(10, 50))
    out = engine.generate([(0, prompt, SamplingParams(temperature=0.0, max_tokens=None,
                                                      ignore_eos=True))])[0]
    assert out.finish_reason == "length"
    assert out.num_prompt_tokens + out.num_output_tokens == 48


def test_no_detokenize(engine, greedy):
    ids = greedy[0]
    k = _first_new(ids, 2)
    out = run(engine, max_tokens=40, ignore_eos=True, detokenize=False,
              stop_token_ids=[ids[k]])
    assert out.output_text is None
    assert out.output_token_ids == ids[:k + 1]
