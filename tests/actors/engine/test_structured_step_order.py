"""The engine's step order with structured outputs: while the next step's masks fill (the
ahead fill), the previous step's outputs are processed between the forward's launch and the
sampler's, and the sequences that finished are freed only after that sampler's launch. The
outputs equal those of the order that launches the whole step first."""

from __future__ import annotations

from sampler import SamplingParams
from tests.actors.engine.structured_checks import (ARITHMETIC_LARK, DATE_REGEX, PERSON_SCHEMA,
                                                   check_output, compile_first)
from tests.actors.helpers import by_id, make_engine, random_prompts

JSON = {"json": PERSON_SCHEMA, "disable_any_whitespace": True}
REGEX = {"regex": DATE_REGEX}


def _requests() -> list:
    """Constrained rows that end at different steps (grammar ends, short max_tokens), two
    samples of one, top logprobs on one, and unconstrained rows beside them."""
    prompts = random_prompts([6, 11, 4, 9, 7, 5, 8], 512, seed=21)
    params = [
        SamplingParams(temperature=1.0, max_tokens=40, seed=3, structured_outputs=JSON),
        SamplingParams(temperature=1.0, max_tokens=12, seed=4, structured_outputs=JSON),
        SamplingParams(temperature=1.0, max_tokens=30, seed=5, structured_outputs=REGEX, n=2),
        SamplingParams(temperature=1.0, max_tokens=30, seed=6, structured_outputs=REGEX,
                       logprobs=3),
        SamplingParams(temperature=1.0, max_tokens=7, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=40, seed=8,
                       structured_outputs={"choice": ["alpha", "beta gamma"]}),
    ]
    return [(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def _run(model: str, split: bool, max_templates: int | None = None) -> tuple[dict, list[str]]:
    """The outputs by (id, sample index), and the engine's calls in order: ``model`` (inputs,
    forward, LM head), ``sample`` and ``process`` (a launched step read back)."""
    engine = make_engine(model)
    if max_templates is not None:
        engine.structured.max_templates = max_templates
    calls: list[str] = []
    executor = engine.executor
    launch_model, sample, process = executor.launch_model, executor.sample, engine._process

    def spy_model(*args):
        calls.append("model")
        return launch_model(*args)

    def spy_sample(*args):
        calls.append("sample")
        return sample(*args)

    def spy_process(step):
        calls.append("process")
        return process(step)

    executor.launch_model, executor.sample, engine._process = spy_model, spy_sample, spy_process
    if not split:  # the launch-first order at every step
        engine.structured.filling_after = lambda output: False
    try:
        requests = _requests()
        compile_first(engine, requests)  # the same batches in both orders
        outputs = by_id(engine.generate(requests))
        assert engine.structured.num_active == 0 and not engine.scheduler.running
        assert engine.sampler.state.active.sum() == 0  # every slot freed
    finally:
        engine.close()
    return outputs, calls


def _between(calls: list[str]) -> int:
    """How many steps processed the step before between their forward and their sampler."""
    return sum(calls[i:i + 3] == ["model", "process", "sample"] for i in range(len(calls)))


def test_outputs_processed_while_the_masks_fill_equal_the_launch_first_order(tiny_llama):
    split, split_calls = _run(tiny_llama, split=True)
    first, first_calls = _run(tiny_llama, split=False)
    assert _between(first_calls) == 0
    assert _between(split_calls) >= 10  # every decode step after the first with masks
    assert split.keys() == first.keys() and len(split) == 8
    for key, out in split.items():
        other = first[key]
        assert out.output_token_ids == other.output_token_ids, key
        assert (out.finish_reason, out.stop_reason) == (other.finish_reason, other.stop_reason)
        assert out.logprobs == other.logprobs and out.top_logprobs == other.top_logprobs
    assert split[(1, 0)].finish_reason == "length" and split[(4, 0)].num_output_tokens == 7
    for i, so in ((0, JSON), (2, REGEX), (3, REGEX)):
        if split[(i, 0)].finish_reason == "stop":
            check_output(split[(i, 0)], so)


def _mixed_batch_outputs(model: str, launch_first: bool) -> dict:
    """20 rows in one batch (five kinds of constraint, unconstrained rows beside them); with
    ``launch_first`` every step is launched whole first, and each ahead fill's accept starts
    5 ms late and checks that no row's matcher took its token before it."""
    import threading
    import time

    kinds = [JSON, REGEX, {"choice": ["yes", "no", "it depends"]},
             {"grammar": ARITHMETIC_LARK}, {"json_object": True, "disable_any_whitespace": True}]
    prompts = random_prompts([5 + 3 * i for i in range(20)], 400, seed=9)
    requests = [(i, p, SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=60, seed=50 + i,
        structured_outputs=kinds[i % 5] if i % 4 != 3 else None, ignore_eos=i % 4 == 3))
        for i, p in enumerate(prompts)]
    engine = make_engine(model, max_num_seqs=32, max_num_batched_tokens=2048)
    structured = engine.structured
    taken_before = []
    if launch_first:
        structured.filling_after = lambda output: False
        accept = structured._accept_par

        def late_accept(grammars, tokens, matchers=None):
            if threading.current_thread() is not threading.main_thread():  # the fill's
                time.sleep(0.005)
                taken_before.extend(g for g in grammars if g.num_accepted != g.mask_at - 1)
            return accept(grammars, tokens, matchers=matchers)

        structured._accept_par = late_accept
    try:
        compile_first(engine, requests)
        outputs = by_id(engine.generate(requests))
    finally:
        engine.close()
    assert not taken_before  # the stepping thread accepted no token the fill was to accept
    assert len(outputs) == 20
    for (i, _), out in outputs.items():
        assert out.error is None, (i, out.error)
        so = requests[i][2].structured_outputs
        if so is not None and out.finish_reason == "stop":
            check_output(out, so.to_dict())
    return outputs


def test_the_launch_first_order_reads_a_step_back_after_its_fill_accepted(tiny_llama):
    """Whatever decides the step order (here every step launched whole first), a step's
    outputs are read back only once the ahead fill running after it has accepted its
    tokens. The last step (nothing launched after it) is read back while its fill runs:
    had the stepping thread not waited, it would accept the rows' last tokens itself,
    before or beside the fill's accept of the same matchers (llguidance: "Already
    borrowed"). The outputs are the split order's."""
    split = _mixed_batch_outputs(tiny_llama, launch_first=False)
    first = _mixed_batch_outputs(tiny_llama, launch_first=True)
    for key, out in split.items():
        assert (out.output_token_ids, out.finish_reason) == \
            (first[key].output_token_ids, first[key].finish_reason), key


def test_a_step_is_read_back_while_the_next_masks_still_fill(tiny_llama):
    """The ahead fill's mask fill is held until the stepping thread has read the previous
    step back: that read-back needs only the accept (``wait_accepted``), so it completes
    while the fill waits, and the run finishes. (Waiting for the whole fill there would
    leave the held fill waiting for a read-back that never comes: a failed fill.)"""
    import threading

    engine = make_engine(tiny_llama)
    structured = engine.structured
    fill, gate = structured._fill, threading.Event()

    def held_fill(targets, buf):
        if threading.current_thread() is not threading.main_thread():  # the ahead fill's
            assert gate.wait(30), "the step before was not read back during the fill"
            gate.clear()
        fill(targets, buf)

    process, during = engine._process, []

    def spy_process(step):
        filling = structured.filling_after(step.output)  # a fill after this step's ids
        out = process(step)
        if filling:  # read back; has that fill finished?
            during.append(not structured._running.future.done())
            gate.set()
        return out

    structured._fill, engine._process = held_fill, spy_process
    try:
        outputs = by_id(engine.generate(_requests()))
    finally:
        engine.close()
    assert sum(during) >= 10
    assert len(outputs) == 8 and all(o.error is None for o in outputs.values())


class _Watched:
    """Stands in for a row's grammar and notes when it is read (its reads and writes go to
    the grammar)."""

    def __init__(self, grammar, state: dict) -> None:
        object.__setattr__(self, "_grammar", grammar)
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name):
        self._state["late" if self._state.get("waiting") else "read"] = True
        return getattr(self._grammar, name)

    def __setattr__(self, name, value):
        setattr(self._grammar, name, value)


def test_a_step_sorts_its_rows_while_its_masks_still_fill(tiny_llama):
    """``step_mask`` decides which rows take a mask from the ahead fill (reading their
    grammars' fields, final once the fill has accepted) before it waits for the fill's masks,
    so that work is off the chain between two samplers; a step that samples the fill's rows
    again reads no row at all."""
    engine = make_engine(tiny_llama)
    structured = engine.structured
    step_mask, settle = structured.step_mask, structured.settle
    state: dict = {"inside": False}
    steps: list[tuple[bool, bool]] = []  # (rows read before the wait, rows read after it)

    def spy_step_mask(seqs, prev_tokens):
        row = next((seq for seq in seqs if seq.grammar is not None), None)
        if row is None:
            return step_mask(seqs, prev_tokens)
        grammar = row.grammar
        row.grammar = _Watched(grammar, state)
        state.update(inside=True, read=False, late=False, waiting=False,
                     filling=structured._running is not None)
        try:
            return step_mask(seqs, prev_tokens)
        finally:
            row.grammar, state["inside"] = grammar, False
            if state["waiting"]:
                steps.append((state["read"], state["late"]))

    def spy_settle(output=None, behind=True):
        if state["inside"] and state["filling"]:
            state["waiting"] = True
        return settle(output, behind)

    hand_over = structured.buffers.hand_over

    def spy_hand_over(masks, rows, fill=None):  # the wait for the fill's masks, handed over
        if state["inside"] and state["filling"] and fill is not None:
            state["waiting"] = True
        return hand_over(masks, rows, fill)

    structured.step_mask, structured.settle = spy_step_mask, spy_settle
    structured.buffers.hand_over = spy_hand_over
    try:
        outputs = by_id(engine.generate(_requests()))
    finally:
        engine.close()
    assert len(steps) >= 10 and not any(late for _, late in steps)
    assert sum(read for read, _ in steps) >= 3  # steps whose rows changed: sorted ahead
    assert sum(not read for read, _ in steps) >= 3  # the same rows again: none read
    assert len(outputs) == 8 and all(o.error is None for o in outputs.values())


def test_steps_of_the_fill_rows_again_take_the_masks_as_a_sorted_step_would(tiny_llama,
                                                                         monkeypatch):
    """A step that samples the rows of the fill before it (``continues``: no row came or
    went) reuses that fill's order and row map instead of reading each row: the outputs
    equal those of every step sorting its rows."""
    from actors.engine import structured as structured_module
    from actors.engine import structured_sequence

    continues = structured_module.continues
    taken: list[bool] = []

    def spy(plan, seqs):
        taken.append(continues(plan, seqs))
        return taken[-1]

    # a template a row, three in turn: the masks' order is not the rows' (a row map to reuse)
    monkeypatch.setattr(structured_sequence, "ROWS_PER_TEMPLATE", 1)
    monkeypatch.setattr(structured_module, "continues", spy)
    fast, _ = _run(tiny_llama, split=True, max_templates=3)
    monkeypatch.setattr(structured_module, "continues", lambda plan, seqs: False)
    slow, _ = _run(tiny_llama, split=True, max_templates=3)
    assert sum(taken) >= 10 and not all(taken)
    assert fast.keys() == slow.keys() and len(fast) == 8
    for key, out in fast.items():
        other = slow[key]
        assert out.output_token_ids == other.output_token_ids, key
        assert (out.finish_reason, out.logprobs, out.top_logprobs) == \
            (other.finish_reason, other.logprobs, other.top_logprobs)


def test_a_fill_that_fails_fails_the_step_whose_masks_it_was_writing(tiny_llama):
    """A step takes the ahead fill's masks before they are written (the upload, on the CPU
    the copy, waits for the fill's number); when that fill fails, the device is never left
    waiting, and the error fails the engine before the outputs of the step sampled under
    those masks are read: none of them reaches an output."""
    import threading

    import pytest

    engine = make_engine(tiny_llama)
    structured = engine.structured
    fill, apply_step = structured._fill, engine.outputs.apply_step
    state = {"ahead": 0, "failed": False, "read_after": 0}

    def failing_fill(targets, buf):
        if threading.current_thread().name.startswith("grammar-ahead"):
            state["ahead"] += 1
            if state["ahead"] == 4:
                state["failed"] = True
                raise RuntimeError("the fill failed")
        return fill(targets, buf)

    def counted_apply_step(*args, **kwargs):
        if state["failed"]:
            state["read_after"] += 1
        return apply_step(*args, **kwargs)

    structured._fill = failing_fill
    engine.outputs.apply_step = counted_apply_step
    try:
        with pytest.raises(RuntimeError, match="the fill failed"):
            engine.generate(_requests())
    finally:
        engine.close()  # joins every fill: nothing hangs
    assert state["failed"] and state["read_after"] <= 1
