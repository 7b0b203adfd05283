"""The constraints as compiled (llguidance) hold the strict definitions: RFC 8259 JSON strings,
code-point lengths, top-level objects for json_object, and regex classes as Python's ``re``
reads them. Also: the masks cover the padded vocab, EOS only where the grammar may end."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from actors.engine.structured import StructuredOutputs
from sampler.structured_params import StructuredOutputsParams as SO

VOCAB = 600  # the tiny tokenizer has 512 tokens: 88 padded ids


@pytest.fixture(scope="module")
def structured():
    from toolkit.tiny_model import train_tokenizer

    tok = train_tokenizer(512)
    out = StructuredOutputs(tok, vocab_size=VOCAB, eos_token_ids=[tok.eos_token_id],
                            device=torch.device("cpu"), max_num_seqs=4)
    yield out
    out.close()


def accepts(structured, so: SO, text: bytes) -> bool:
    """Whether the compiled constraint accepts ``text`` as a whole output."""
    compiled = structured.submit(so).result()
    assert compiled.error is None, compiled.error
    matcher = compiled.template.deep_copy()
    tokens = structured.compiler.ll_tokenizer().tokenize_bytes(text)
    return bool(matcher.consume_tokens(tokens) and matcher.is_accepting())


def _request(structured, so: SO, prompt=(1,)):
    """A request under ``so`` (compiling on ``structured``'s pool) for sequences to start."""
    from actors.engine.sequence import Request
    from sampler import SamplingParams

    request = Request("r", list(prompt), SamplingParams(), 0, 0)
    request.grammar = structured.submit(so)
    return request


SHORT = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
         "required": ["s"], "additionalProperties": False}


@pytest.mark.parametrize("text,ok", [
    (b'{"s":"abc"}', True),
    (b'{"s":"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"}', True),  # 5 code points, 10 bytes
    (b'{"s":"abcdef"}', False),
    (b'{"s":"a\x01b"}', False),  # raw control character (with maxLength)
    (b'{"s":"a\nb"}', False),
    (b'{"s":"\xed\xa0\x80"}', False),  # a UTF-8-encoded surrogate (decodes to U+FFFD)
    (b'{"s":"\\ud800"}', False),  # a lone surrogate escape
])
def test_json_strings_are_strict(structured, text, ok):
    assert accepts(structured, SO(json=SHORT, disable_any_whitespace=True), text) is ok
    assert accepts(structured, SO(json=SHORT), text) is ok  # free whitespace, same strings


@pytest.mark.parametrize("text,ok", [
    (b'{}', True), (b'{"a":[1,{"b":null}],"c":"x"}', True), (b'{"a":-2.5e-12}', True),
    (b'[1,2]', False), (b'"x"', False), (b'{"a":NaN}', False), (b'{"a":Infinity}', False),
    (b'{"a":1e400}', False),  # finite doubles only
    (b'{"a":"\x01"}', False), (b'{"a":"\xed\xa0\x80"}', False), (b'{"a":01}', False),
])
def test_json_object_is_a_top_level_object(structured, text, ok):
    assert accepts(structured, SO(json_object=True, disable_any_whitespace=True), text) is ok


def test_whitespace_options(structured):
    spaced = b'{"s": "abc"}'
    assert accepts(structured, SO(json=SHORT), spaced)
    assert not accepts(structured, SO(json=SHORT, disable_any_whitespace=True), spaced)
    assert not accepts(structured, SO(json=SHORT, whitespace_pattern=r"[\n]?"), spaced)
    assert accepts(structured, SO(json=SHORT, whitespace_pattern=r" ?"), spaced)
    assert accepts(structured, SO(json_object=True), b'{ "a" : 1 }')
    assert not accepts(structured, SO(json_object=True, disable_any_whitespace=True),
                       b'{ "a" : 1 }')


# code points where llguidance's own classes and Python's differ (and some where they agree)
CHARS = ["a", "Z", "5", "_", " ", "\t", "\n", "\x0b", "\x1c", "\x1d", "\x1f", "\x85", "\xa0",
         "\u00b2", "\u00bd", "\u0300", "\u0301", "\u0663", "\u00e9", "\u2028", "\u3000", "-",
         "\u09f4", "\U0001d7ce"]


@pytest.mark.parametrize("pattern", [r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", r"[\w-]",
                                     r"[^\d]", r"[\S\d]", r"(?a)\w", r"."])
def test_regex_classes_as_python_reads_them(structured, pattern):
    for c in CHARS:
        want = re.fullmatch(pattern, c) is not None
        assert accepts(structured, SO(regex=pattern), c.encode()) is want, (pattern, c)


def test_regex_anchors_and_literals(structured):
    assert accepts(structured, SO(regex=r"^ab+$"), b"abb")
    assert accepts(structured, SO(regex=r"a\$"), b"a$")
    assert accepts(structured, SO(regex=r"[]a]+"), b"]a]")
    assert not accepts(structured, SO(regex=r"[0-9]{2}"), "\u0663\u0663".encode())


def test_compile_errors_name_the_field(structured):
    for so, field in ((SO(json={"type": "objectx"}), "json"),
                      (SO(grammar="start: nope"), "grammar"),
                      (SO(regex=r"(?<=a)b"), "regex")):
        error = structured.submit(so).result().error
        assert error.startswith(f"sampling_params.structured_outputs.{field}:"), error


def test_masks_cover_the_padded_vocab_and_allow_eos_only_at_an_end(structured):
    from actors.engine.sequence import Sequence

    tok = structured.compiler.tokenizer
    eos = tok.eos_token_id
    request = _request(structured, SO(regex="(ab)+"), prompt=[1, 2])
    seqs = [Sequence(request, 0, [1, 2]) for _ in range(2)]
    for seq in seqs:
        structured.start(seq)
    seqs[1].token_ids += tok.encode("ab", add_special_tokens=False)
    mask = structured.step_mask(seqs, prev_tokens=None)
    from sampler.ops.token_bitmask import unpack_token_bitmask

    allowed = unpack_token_bitmask(mask.bits, VOCAB)
    assert mask.rows.tolist() == [0, 1] and mask.row_map.tolist() == [0, 1]
    assert not allowed[:, len(tok):].any()  # ids past the tokenizer's vocab
    assert not allowed[0, eos] and allowed[1, eos]  # "(ab)+" may end only after "ab"
    for t in torch.nonzero(allowed[0])[:, 0].tolist():
        assert "ab".startswith(tok.decode([t])) or tok.decode([t]).startswith("ab")
    for seq in seqs:
        structured.release(seq)
    assert structured.num_active == 0


def test_new_rows_take_their_constraints_first_mask_as_the_library_fills_it(structured):
    """Rows that have accepted no token take their constraint's first mask (filled once from
    the template); it equals the library's fill of each row's own matcher, beside a row
    with tokens, for two constraints."""
    import llguidance.torch

    from actors.engine.sequence import Sequence

    tok = structured.compiler.tokenizer
    requests = [_request(structured, SO(regex="(ab)+")), _request(structured, SO(json=SHORT))]
    seqs = [Sequence(requests[i % 2], 0, [1]) for i in range(4)]
    for seq in seqs:
        structured.start(seq)
    ab = tok.encode("ab", add_special_tokens=False)
    seqs[2].token_ids += ab  # accepted here
    bits = structured.step_mask(seqs, prev_tokens=None).bits
    assert [seq.grammar.num_accepted for seq in seqs] == [0, 0, len(ab), 0]
    own = torch.zeros_like(bits)
    for i, seq in enumerate(seqs):
        llguidance.torch.fill_next_token_bitmask(seq.grammar.matcher, own, i)
    assert torch.equal(bits, own)
    assert not torch.equal(bits[0], bits[1]) and not torch.equal(bits[0], bits[2])
    for seq in seqs:
        structured.release(seq)


def test_many_sequences_of_one_constraint_spread_over_templates_with_the_same_masks():
    from actors.engine.sequence import Sequence
    from actors.engine.structured_sequence import ROWS_PER_TEMPLATE
    from sampler.ops.token_bitmask import unpack_token_bitmask
    from toolkit.tiny_model import train_tokenizer

    tok = train_tokenizer(512)
    n = 2 * ROWS_PER_TEMPLATE + 6
    structured = StructuredOutputs(tok, vocab_size=VOCAB, eos_token_ids=[tok.eos_token_id],
                                   device=torch.device("cpu"), max_num_seqs=n, fill_threads=3)
    request = _request(structured, SO(json=SHORT))
    texts = ['{"s":"a', '{"s":', '{', '{"s":"abcde"']
    seqs = []
    for i in range(n):
        seq = Sequence(request, 0, [1])
        structured.start(seq)
        seq.token_ids += tok.encode(texts[i % len(texts)], add_special_tokens=False)
        seqs.append(seq)
    groups = [seq.grammar.group for seq in seqs]
    assert groups == [i // ROWS_PER_TEMPLATE for i in range(n)]  # three templates
    allowed = unpack_token_bitmask(structured.step_mask(seqs, prev_tokens=None).bits, VOCAB)
    assert all(seq.grammar.num_accepted == len(seq.token_ids) - 1 for seq in seqs)
    for i in range(len(texts), n):  # same text, any template: the same mask
        assert torch.equal(allowed[i], allowed[i % len(texts)]), i
    assert len({tuple(allowed[i].tolist()) for i in range(len(texts))}) == len(texts)
    structured.close()


class _Sampled:
    """An ``AsyncOutput`` of a step's sampled ids, already on the host."""

    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = np.asarray(tokens, dtype=np.int64)

    def get(self) -> "_Sampled":
        return self


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
def test_step_masks_and_accepts_equal_a_per_row_reference_over_random_steps(ahead):
    """Rows of one shared schema (several templates) and of two other constraints
    step as in the engine (the previous step's ids pending, or already applied, or several
    tokens at once, a refused token now and then, rows ending and new ones starting); every
    mask equals the one of a matcher of the row's own, fed the same tokens one at a time.
    ``ahead``: after each step the sampled ids go to ``advance``, as the executor does, so
    most masks come from the ahead fill and the rest (new rows, rows given two tokens, the
    rows after a refused token) are filled in ``step_mask`` into the same buffer."""
    import numpy as np

    from actors.engine.sequence import PENDING, Sequence
    from actors.engine.structured_sequence import ROWS_PER_TEMPLATE
    from toolkit.tiny_model import train_tokenizer

    tok = train_tokenizer(512)
    eos = tok.eos_token_id
    n = 2 * ROWS_PER_TEMPLATE + 8
    structured = StructuredOutputs(tok, vocab_size=VOCAB, eos_token_ids=[eos],
                                   device=torch.device("cpu"), max_num_seqs=n, fill_threads=3)
    requests = [_request(structured, SO(json=SHORT, disable_any_whitespace=True))] * 6 + [
        _request(structured, SO(regex="(ab|c)+[0-9]{1,3}")),
        _request(structured, SO(choice=["yes", "no", "maybe"]))]
    rng = np.random.default_rng(3)

    def allowed(words: np.ndarray) -> np.ndarray:
        return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))

    def new_row(i: int):
        seq = Sequence(requests[i % len(requests)], 0, [1])
        structured.start(seq)
        ref = seq.request.grammar.result().template.deep_copy()
        return [seq, ref, -1]  # -1: the output tokens after which ref stopped (not yet)

    def ref_took(row) -> None:  # SequenceGrammar.stopped_at's rule, on the reference
        seq, ref, stop = row
        if stop < 0 and not ref.is_error() and ref.is_stopped():
            row[2] = len(seq.token_ids) - seq.num_prompt

    rows = [new_row(i) for i in range(n)]
    started, prev, checked, refused, stopped = n, None, 0, 0, 0
    for step in range(300):
        if prev is not None and step % 3 == 0:  # the previous step's ids applied already
            for (seq, _, _), token in zip(prev[0], prev[1]):
                seq.token_ids[-1] = token
                seq.num_pending -= 1
            prev = None
        for row in rows:  # now and then a row takes two known tokens at once
            seq, ref, _ = row
            if not seq.num_pending and rng.random() < 0.05:
                for _ in range(2):
                    mask = np.frombuffer(ref.compute_bitmask(), dtype=np.int32)
                    token = int(rng.choice(allowed(mask)))
                    assert ref.consume_token(token)
                    seq.token_ids.append(token)
                    ref_took(row)
        seqs = [seq for seq, _, _ in rows]
        tokens = prev[1] if prev is not None else None
        mask = structured.step_mask(seqs, lambda: np.asarray(tokens))
        bits = mask.bits.numpy()
        assert mask.rows.tolist() == list(range(len(rows)))
        drawn = []
        for j, (seq, ref, stop) in enumerate(rows):
            assert seq.grammar.num_accepted == len(seq.token_ids) - 1
            assert (seq.grammar.error is None) == (not ref.is_error()), j
            assert seq.grammar.stopped_at == stop, j
            assert np.array_equal(bits[j], np.frombuffer(ref.compute_bitmask(), np.int32)), j
            checked += 1
            token = int(rng.choice(allowed(bits[j])))
            if rng.random() < 0.01:
                token = int(rng.integers(3, 512))  # maybe refused: both must agree
            ref.consume_token(token)  # what step_mask must do with it next step
            drawn.append(token)
            seq.token_ids.append(PENDING)
            ref_took(rows[j])
            seq.num_pending += 1
            seq.pending_row = j
        prev = (rows, drawn)
        if ahead:  # the engine changes no row before the ahead fill settles
            structured.advance(seqs, [len(seq.token_ids) - 1 for seq in seqs],
                               _Sampled(drawn))
            structured.settle()
        # rows that reached an end with this token, or whose refused token step_mask saw,
        # end; new rows replace them
        ended = [j for j, (seq, ref, _) in enumerate(rows)
                 if (seq.grammar.error is not None if ref.is_error()
                     else ref.is_stopped() or drawn[j] == eos)]
        if ended:
            for (seq, _, _), token in zip(rows, drawn):
                seq.token_ids[-1] = token
                seq.num_pending -= 1
            for j in ended:
                seq = rows[j][0]
                seq.grammar.catch_up(seq)  # as the output processor does before it ends
                assert (seq.grammar.error is None) == (not rows[j][1].is_error())
                assert seq.grammar.stopped_at == rows[j][2]  # at the token it stopped after
                stopped += rows[j][2] > 0
                refused += seq.grammar.error is not None
                structured.release(seq)
                rows[j] = new_row(started)
                started += 1
            prev = None
    assert checked > 300 * (n - 8) and started > n + 20 and refused > 3, (started, refused)
    assert stopped > 10, stopped
    if ahead:
        assert structured.rows_ahead > 0.8 * checked and structured.rows_here > n
    else:
        assert structured.rows_ahead == 0
    structured.close()


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
def test_a_sampled_token_that_ends_the_grammar_is_the_stop_of_its_row(ahead):
    """Rows step through the words of a choice one sampled token at a time (the parallel
    accept, in step or ahead): each stops after its word's last token, not before."""
    from actors.engine.sequence import PENDING, Sequence
    from toolkit.tiny_model import train_tokenizer

    tok = train_tokenizer(512)
    words = ["yes", "no", "maybe", "no"]
    structured = StructuredOutputs(tok, vocab_size=VOCAB, eos_token_ids=[tok.eos_token_id],
                                   device=torch.device("cpu"), max_num_seqs=8, fill_threads=2)
    request = _request(structured, SO(choice=sorted(set(words))))
    ids = [tok.encode(w, add_special_tokens=False) for w in words]
    seqs = [Sequence(request, 0, [1]) for _ in words]
    for seq in seqs:
        structured.start(seq)
    prev = None  # the ids sampled last step
    for step in range(max(map(len, ids)) + 1):
        # the rows whose last token is still to accept (in step) or whose mask is taken
        structured.step_mask([s for s, t in zip(seqs, ids) if step <= len(t)],
                             lambda: np.asarray(prev))
        for seq, tokens in zip(seqs, ids):
            grammar, stop = seq.grammar, len(tokens)  # row j may only end after its word
            assert grammar.error is None and grammar.num_accepted == min(step, stop)
            assert grammar.stopped_at == (stop if step >= stop else -1)
            assert grammar.ended_by(stop) == (step >= stop) and not grammar.ended_by(stop - 1)
            if seq.num_pending:  # the previous step's id, as the output processor applies it
                seq.token_ids[-1] = prev[seq.pending_row]
                seq.num_pending -= 1
        sampled = [j for j, tokens in enumerate(ids) if step < len(tokens)]
        prev = [ids[j][step] for j in sampled]
        for row, j in enumerate(sampled):
            seqs[j].token_ids.append(PENDING)
            seqs[j].num_pending += 1
            seqs[j].pending_row = row
        if ahead and sampled:
            structured.advance([seqs[j] for j in sampled],
                               [len(seqs[j].token_ids) - 1 for j in sampled], _Sampled(prev))
    assert [seq.grammar.stopped_at for seq in seqs] == [len(t) for t in ids]
    structured.close()


