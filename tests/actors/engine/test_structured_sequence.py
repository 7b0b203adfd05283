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
