"""Structured outputs through the engine on a tiny random model (its free text is gibberish:
only the constraint makes the output valid)."""

from __future__ import annotations

import math
import re

import pytest

from sampler import SamplingParams
from sampler.slot_params import MIN_TOKENS
from tests.actors.helpers import by_id, make_engine, random_prompts
from tests.actors.engine.structured_checks import (ARITHMETIC_GBNF, ARITHMETIC_LARK, DATE_REGEX,
                                            PERSON_SCHEMA, check_output, is_arithmetic,
                                            strict_json)

COMPACT = {"disable_any_whitespace": True}
KINDS = {
    "json": {"json": PERSON_SCHEMA, **COMPACT},
    "regex": {"regex": DATE_REGEX},
    "choice": {"choice": ["yes", "no", "it depends"]},
    "grammar": {"grammar": ARITHMETIC_LARK},
    "gbnf": {"grammar": ARITHMETIC_GBNF},
    "json_object": {"json_object": True, **COMPACT},
}


def _params(so: dict, seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 120, "seed": seed,
                             "structured_outputs": so, **kw})


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_finished_row_of_each_kind_is_valid(llama_engine, kind):
    so = KINDS[kind]
    requests = [(f"{kind}{i}", "Hello there", _params(so, seed=100 + i)) for i in range(8)]
    outs = llama_engine.generate(requests)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    # free JSON strings of a random model run long: fewer objects close within max_tokens
    assert len(stopped) >= (2 if kind == "json_object" else 6), \
        [(o.finish_reason, o.output_text) for o in outs]
    for out in stopped:
        check_output(out, so)
        assert out.error is None
    for out in outs:
        assert out.finish_reason in ("stop", "length")


def test_unconstrained_text_of_the_model_is_not_valid(llama_engine):
    """The model alone does not produce these texts: the constraint does."""
    outs = llama_engine.generate([(i, "Hello there", SamplingParams(seed=100 + i, max_tokens=40))
                                  for i in range(8)])
    assert not any(is_arithmetic(o.output_text) for o in outs)
    for out in outs:
        with pytest.raises(ValueError):
            strict_json(out.output_text)


def test_mixed_batch_each_row_its_own_constraint_and_seeded_rows_equal_alone(llama_engine):
    prompts = random_prompts([5, 9, 3, 7, 6, 4, 8, 5], 512, seed=3)
    kinds = [None, "json", "regex", None, "choice", "grammar", "json_object", "gbnf"]
    requests = [(i, p, _params(KINDS[k], seed=7 + i) if k else
                 SamplingParams(temperature=1.0, max_tokens=20, seed=7 + i, ignore_eos=True))
                for i, (p, k) in enumerate(zip(prompts, kinds))]
    structured = llama_engine.structured
    ahead, here = structured.rows_ahead, structured.rows_here
    mixed = by_id(llama_engine.generate(requests))
    # most steps' masks were filled while the step before ran (StructuredOutputs.advance)
    assert structured.rows_ahead - ahead > 2 * (structured.rows_here - here) > 0
    for i, kind in enumerate(kinds):
        out = mixed[(i, 0)]
        if kind is None:
            assert out.finish_reason == "length" and out.num_output_tokens == 20
        elif out.finish_reason == "stop":
            check_output(out, KINDS[kind])
    for i in (1, 2, 5, 0):  # alone: the same tokens
        alone = llama_engine.generate([requests[i]])[0]
        assert alone.output_token_ids == mixed[(i, 0)].output_token_ids, i
        assert alone.finish_reason == mixed[(i, 0)].finish_reason


def test_bad_constraints_are_row_errors_naming_the_field_and_other_rows_run(llama_engine):
    requests = [
        ("bad_schema", "Hi", _params({"json": {"type": "objectx"}}, seed=1)),
        ("bad_grammar", "Hi", _params({"grammar": "start: missing_rule"}, seed=2)),
        ("bad_regex", "Hi", _params({"regex": r"a(?=b)"}, seed=3)),  # no lookarounds
        ("good", "Hi", _params(KINDS["choice"], seed=4)),
        ("plain", "Hi", SamplingParams(max_tokens=5, seed=5)),
    ]
    outs = by_id(llama_engine.generate(requests))
    for rid, field in (("bad_schema", "json"), ("bad_grammar", "grammar"),
                       ("bad_regex", "regex")):
        out = outs[(rid, 0)]
        assert out.finish_reason == "error", rid
        assert f"sampling_params.structured_outputs.{field}" in out.error
        assert not out.output_token_ids
    assert outs[("good", 0)].output_text in KINDS["choice"]["choice"]
    assert outs[("plain", 0)].num_output_tokens == 5
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: only one kind"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    # an invalid Python regex is refused at validation already: a row error too
    out = llama_engine.generate([("bad_re", "Hi", {"structured_outputs": {"regex": "("}})])[0]
    assert out.finish_reason == "error" and "structured_outputs.regex" in out.error


def test_truncated_rows_end_length(llama_engine):
    so = {"json": PERSON_SCHEMA, **COMPACT}
    outs = llama_engine.generate([(i, "Hello", _params(so, seed=i, max_tokens=4))
                                  for i in range(4)])
    for out in outs:
        assert out.finish_reason == "length" and out.num_output_tokens == 4
        assert out.output_text.startswith('{"name":"'[:len(out.output_text)]) or \
            out.output_text.startswith('{"')


def test_n_samples_each_follow_the_grammar(llama_engine):
    outs = llama_engine.generate([("n", "Count:", _params(KINDS["grammar"], seed=11, n=4))])
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    for out in outs:
        if out.finish_reason == "stop":
            assert is_arithmetic(out.output_text)
    assert len({tuple(o.output_token_ids) for o in outs}) > 1


def test_grammar_end_stops_without_eos_and_eos_only_where_it_may_end(llama_engine):
    """A choice ends at its last character (no EOS sampled); a regex that may go on ends
    only with EOS, sampled only where the pattern may end."""
    eos = llama_engine.sampler.eos_token_ids
    outs = llama_engine.generate([(i, "Hi", _params({"choice": ["alpha", "beta"]}, seed=i))
                                  for i in range(4)])
    for out in outs:
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.output_text in ("alpha", "beta")
        assert not set(out.output_token_ids) & set(eos)
    outs = llama_engine.generate([(i, "Hi", _params({"regex": "(ab)+"}, seed=i, max_tokens=30))
                                  for i in range(4)])
    for out in outs:
        if out.finish_reason == "stop":
            # as vLLM: an EOS token ends the row with no stop reason
            assert out.output_token_ids[-1] in eos and out.stop_reason is None
            assert len(out.output_text) % 2 == 0


def test_logprobs_raw_before_the_mask_processed_after(llama_engine):
    so = KINDS["choice"]
    raw = llama_engine.generate([("r", "Hi", _params(so, seed=3, logprobs=5,
                                                     temperature=0.0))])[0]
    proc = llama_engine.generate([("p", "Hi", _params(so, seed=3, logprobs=5, temperature=0.0,
                                                      logprobs_mode="processed_logprobs"))])[0]
    assert raw.output_token_ids == proc.output_token_ids
    # processed: renormalised over the allowed tokens, each top entry allowed (a prefix of
    # a choice) or -inf; raw: the model's own distribution, disallowed tokens included
    tok = llama_engine.tokenizer
    assert proc.logprobs[0] > raw.logprobs[0]

    def allowed(token_id):
        text = tok.decode([token_id])
        return any(c.startswith(text) for c in so["choice"])

    top_proc, top_raw = proc.top_logprobs[0], raw.top_logprobs[0]
    assert all(allowed(e["token_id"]) for e in top_proc if not math.isinf(e["logprob"]))
    assert not all(allowed(e["token_id"]) for e in top_raw)
    assert all(not math.isinf(e["logprob"]) for e in top_raw)


def test_preemption_keeps_outputs_valid_and_equal(tiny_llama):
    prompts = random_prompts([12, 5, 20, 9, 3, 16, 7, 11], 512, seed=40)
    kinds = ["json", "grammar", "regex", "json_object", "gbnf", "json", "grammar", "regex"]
    requests = [(i, p, _params(KINDS[k], seed=7 + i, max_tokens=36, n=2 if i == 2 else 1))
                for i, (p, k) in enumerate(zip(prompts, kinds))]
    roomy = make_engine(tiny_llama, max_model_len=64)
    expected = by_id(roomy.generate(requests))
    assert roomy.stats.num_preemptions == 0
    tight = make_engine(tiny_llama, max_model_len=60, num_kv_blocks=16, block_size=4)
    got = by_id(tight.generate(requests))
    assert tight.stats.num_preemptions > 0
    assert got.keys() == expected.keys()
    for (i, j), out in got.items():
        assert out.output_token_ids == expected[(i, j)].output_token_ids, (i, j)
        assert out.finish_reason == expected[(i, j)].finish_reason
        if out.finish_reason == "stop":
            check_output(out, KINDS[kinds[i]])
    assert tight.structured.num_active == 0


def test_prefix_caching_unaffected(tiny_llama):
    prompt = random_prompts([24], 512, seed=5)[0]
    engine = make_engine(tiny_llama, enable_prefix_caching=True)
    first = engine.generate([("a", prompt, _params(KINDS["json"], seed=1))])[0]
    again = engine.generate([("b", prompt, _params(KINDS["json"], seed=1))])[0]
    assert engine.stats.num_cached_prompt_tokens > 0
    assert again.output_token_ids == first.output_token_ids


def test_compiles_once_per_distinct_constraint_and_compiling_rows_wait(llama_engine):
    """Equal constraints share one compile; a row whose constraint is still compiling is
    passed over by the scheduler: the rows queued behind it run and finish meanwhile."""
    import threading

    structured = llama_engine.structured
    so = {"regex": r"[a-c]{3,5}x"}
    a = structured.submit(SamplingParams(structured_outputs=so).structured_outputs)
    b = structured.submit(SamplingParams(structured_outputs=dict(so)).structured_outputs)
    assert a is b and a.result().error is None

    release = threading.Event()
    compile_now = structured.compiler._compile

    def slow_compile(constraint):
        release.wait(timeout=60)
        return compile_now(constraint)

    structured.compiler._compile = slow_compile
    try:
        llama_engine.add_request("slow", "Hi", _params({"regex": r"q[0-9]{2}z"}, seed=1))
        llama_engine.add_request("fast", "Hi", SamplingParams(max_tokens=3, seed=2))
        done = []
        while not done:
            done += [o for o in llama_engine.step() if o.id == "fast"]
        assert done[0].num_output_tokens == 3
        slow = llama_engine.book.requests["slow"].sequences[0]
        assert slow in llama_engine.scheduler.waiting and slow.slot == -1
    finally:
        structured.compiler._compile = compile_now
        release.set()
    outs = []
    while llama_engine.has_unfinished_requests():
        outs += llama_engine.step()
    (out,) = [o for o in outs if o.id == "slow"]
    assert out.finish_reason == "stop" and re.fullmatch(r"q[0-9]{2}z", out.output_text)


def test_min_tokens_does_not_apply_to_constrained_rows(llama_engine):
    outs = llama_engine.generate([(i, "Hi", _params({"choice": ["ok", "no"]}, seed=i,
                                                    min_tokens=10)) for i in range(3)])
    for out in outs:
        assert out.finish_reason == "stop" and out.output_text in ("ok", "no")
    # nor in the sampler's rows of its slot (EOS would stay masked for 10 tokens there)
    llama_engine.add_request("m", "Hi", _params({"regex": "[a-z]{1,30}"}, seed=1,
                                                min_tokens=10))
    llama_engine.step()  # the request is added (its params and rows without min_tokens)
    request = llama_engine.book.requests["m"]
    assert request.params.min_tokens == 0 and request.sampler_rows.i[MIN_TOKENS] == 0
    while llama_engine.has_unfinished_requests():
        llama_engine.step()
