"""EngineConfig.batch_invariant: a step is one sequence's prefill chunk or decodes only."""

from __future__ import annotations

import pytest

from tests.actors.helpers import hf_logits, make_engine, random_prompts


def recorded_steps(engine):
    """Wraps the scheduler: each step's chunks as [(prefill?, num_tokens)]."""
    steps = []
    schedule = engine.scheduler.schedule

    def wrapped():
        out = schedule()
        steps.append([(c.start < c.seq.num_prompt_tokens, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = wrapped
    return steps


@pytest.mark.parametrize("invariant", [False, True])
def test_prefill_chunks_run_alone_only_when_asked(invariant, tiny_llama, hf_reference):
    engine = make_engine(tiny_llama, batch_invariant=invariant, max_num_batched_tokens=48)
    steps = recorded_steps(engine)
    prompts = random_prompts([30, 5, 70, 12, 9], 500, seed=51)  # 70 > the token budget
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "n": 2}
    outs = engine.generate([(i, p, params) for i, p in enumerate(prompts)],
                           token_logprobs=True)
    mixed = [s for s in steps if any(p for p, _ in s) and len(s) > 1]
    if invariant:
        assert not mixed, mixed[:3]
        assert all(n == 1 for s in steps if not any(p for p, _ in s) for _, n in s)
    else:
        assert mixed  # the default packs prefills with decodes (the check can fail)
    model = hf_reference(tiny_llama)
    for out in outs:  # the schedule changes nothing but speed and rounding
        prompt = prompts[out.id]
        logits = hf_logits(model, prompt + out.output_token_ids)[len(prompt) - 1:-1]
        assert out.output_token_ids == logits.argmax(-1).tolist()
        want = logits.log_softmax(-1).gather(1, logits.argmax(-1)[:, None])[:, 0].tolist()
        assert out.raw_logprobs == pytest.approx(want, abs=1e-5)


def test_option_is_checked():
    from actors.engine.engine_config import EngineConfig

    assert EngineConfig().batch_invariant is False
    with pytest.raises(ValueError, match="engine.batch_invariant"):
        EngineConfig(batch_invariant="yes")
