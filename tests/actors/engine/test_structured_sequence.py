"""Matcher templates of a constraint many sequences share: one per ``ROWS_PER_TEMPLATE`` live
sequences up to the limit, each new sequence on the template with the fewest live ones."""

from __future__ import annotations

import torch

from actors.engine.sequence import Request, Sequence
from actors.engine.structured import StructuredOutputs
from actors.engine.structured_sequence import ROWS_PER_TEMPLATE
from sampler import SamplingParams

VOCAB = 600


def _structured(max_templates: int):
    from toolkit.tiny_model import train_tokenizer

    tok = train_tokenizer(512)
    structured = StructuredOutputs(tok, vocab_size=VOCAB, eos_token_ids=[tok.eos_token_id],
                                   device=torch.device("cpu"), max_num_seqs=8,
                                   fill_threads=2, max_templates=max_templates)
    params = SamplingParams(structured_outputs={"regex": "(ab|c)+"}, detokenize=False)
    request = Request("r", [1], params, 0, 0)
    request.grammar = structured.submit(params.structured_outputs)
    return structured, request


def _start(structured, request, n: int) -> list[Sequence]:
    seqs = [Sequence(request, 0, [1]) for _ in range(n)]
    for seq in seqs:
        structured.start(seq)
    return seqs


def test_templates_fill_in_blocks_then_take_new_rows_in_turn():
    structured, request = _structured(max_templates=3)
    seqs = _start(structured, request, 4 * ROWS_PER_TEMPLATE + 2)
    groups = [seq.grammar.group for seq in seqs]
    # a block of ROWS_PER_TEMPLATE a template up to the limit, then each in turn
    assert groups[:3 * ROWS_PER_TEMPLATE] == [i // ROWS_PER_TEMPLATE
                                             for i in range(3 * ROWS_PER_TEMPLATE)]
    assert groups[3 * ROWS_PER_TEMPLATE:3 * ROWS_PER_TEMPLATE + 4] == [0, 1, 2, 0]
    assert request.grammar.result().live == [groups.count(g) for g in range(3)]
    assert max(request.grammar.result().live) - min(request.grammar.result().live) <= 1
    structured.close()


def test_a_new_row_takes_the_template_whose_rows_ended():
    structured, request = _structured(max_templates=2)
    seqs = _start(structured, request, 2 * ROWS_PER_TEMPLATE)
    compiled = request.grammar.result()
    assert compiled.live == [ROWS_PER_TEMPLATE, ROWS_PER_TEMPLATE]
    for seq in seqs[ROWS_PER_TEMPLATE:ROWS_PER_TEMPLATE + 3]:  # three rows of template 1
        assert seq.grammar.group == 1
        structured.release(seq)
    assert compiled.live == [ROWS_PER_TEMPLATE, ROWS_PER_TEMPLATE - 3]
    assert [seq.grammar.group for seq in _start(structured, request, 4)] == [1, 1, 1, 0]
    assert structured.num_active == 2 * ROWS_PER_TEMPLATE + 1
    structured.close()


def test_few_rows_share_one_template():
    structured, request = _structured(max_templates=4)
    seqs = _start(structured, request, ROWS_PER_TEMPLATE)
    assert {seq.grammar.group for seq in seqs} == {0}
    assert request.grammar.result().templates == []  # no other template compiled
    for seq in seqs:
        structured.release(seq)
    assert request.grammar.result().live == [0] and structured.num_active == 0
    structured.close()


class _Matcher:
    """A matcher that takes every token but ``refuse`` and ends after ``end``."""

    def __init__(self, refuse: int = -1, end: int = -1) -> None:
        self.refuse, self.end, self.last = refuse, end, None

    def consume_token(self, token: int) -> bool:
        self.last = token
        return token != self.refuse

    def is_stopped(self) -> bool:
        return self.last == self.end

    def get_error(self) -> str:
        return "refused"


def test_apply_step_ends_constrained_rows_as_append_token_does():
    """``OutputProcessor.apply_step`` writes a constrained row's token on its inline path only
    when the grammar took it already, without an error or an end; every other case (taken
    now, refused, ended by it, EOS, the last allowed token) goes through ``append_token``: the
    outcome of each row equals ``append_token``'s on a copy of the row."""
    import copy

    from actors.engine.output_processor import OutputProcessor
    from actors.engine.sequence import PENDING
    from actors.engine.structured_sequence import SequenceGrammar

    eos, prompt = 2, [7, 8, 9]
    params = SamplingParams(max_tokens=4, detokenize=False)
    request = Request("r", prompt, params, 0, 0)
    request.stop_token_ids = {eos}
    op = OutputProcessor(None, max_model_len=1000, vocab_size=VOCAB)
    # (tokens before, the grammar's matcher, whether the ahead fill accepted the new token,
    # the new token)
    cases = [([5], _Matcher(), True, 6),             # taken ahead: inline
             ([5], _Matcher(end=6), True, 6),        # the grammar ended with it: "stop"
             ([5], _Matcher(refuse=6), True, 6),     # refused: "error"
             ([5], _Matcher(), False, 6),            # not taken yet: append_token takes it
             ([5], _Matcher(end=6), False, 6),       # ... and it ends the grammar
             ([5], _Matcher(), True, eos),           # EOS where the grammar may end
             ([5, 5, 5], _Matcher(), True, 6)]       # the last allowed token: "length"
    seqs, pending = [], []
    for before, matcher, ahead, token in cases:
        seq = Sequence(request, 0, list(prompt))
        seq.grammar = SequenceGrammar(matcher)
        seq.grammar.accept(before)
        seq.token_ids += before
        op.start(seq)
        pending.append(len(seq.token_ids))
        seq.token_ids.append(PENDING)
        seq.num_pending += 1
        if ahead:  # as the ahead fill does before the step's outputs are processed
            seq.grammar.accept([token])
        seqs.append(seq)
    copies = copy.deepcopy(seqs)
    tokens = [case[3] for case in cases]
    done = op.apply_step(seqs, pending, tokens, None, None, None, None, None)
    want_done = [c for c, pos, token in zip(copies, pending, tokens)
                 if op.append_token(c, token, pos)]
    assert [seqs.index(s) for s in done] == [copies.index(c) for c in want_done]
    assert [s.finish_reason for s in seqs] == [c.finish_reason for c in copies]
    assert [s.finish_reason for s in seqs] == [None, "stop", "error", None, "stop", "stop",
                                               "length"]
    for seq, copied in zip(seqs, copies):
        assert seq.token_ids == copied.token_ids and seq.num_pending == copied.num_pending
        assert seq.grammar.num_accepted == copied.grammar.num_accepted
        assert (seq.grammar.error is None) == (copied.grammar.error is None)
