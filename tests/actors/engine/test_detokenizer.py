"""Incremental detokenization (multi-byte characters split across tokens), stop-string
search and hold-back."""

from __future__ import annotations

import pytest

from actors.engine.detokenizer import (
    IncrementalDetokenizer,
    TokenPieces,
    find_stop_string,
    visible_text,
)


@pytest.fixture(scope="module")
def tokenizer():
    from toolkit.tiny_model import train_tokenizer

    return train_tokenizer()


@pytest.mark.parametrize("text", [
    "Unicode too: café, naïve, über, 東京, привет, مرحبا, emoji 🙂 and accents àéîõü.",
    "東京🙂🙂 x",
    "The quick brown fox jumps over the lazy dog.",
])
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Hello there")
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces) or text.isascii()  # chars split across tokens
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in ids]
    assert detok.text == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # never emits half a character


def test_flush_emits_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("東")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids[:-1]:
        assert detok.add(t) == ""
    assert detok.flush() == tokenizer.decode(ids[:-1])


def test_skip_leaves_out_the_token_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for t in tokenizer.encode("abc"):
        detok.add(t)
    detok.skip(tokenizer.eos_token_id)
    assert detok.text == "abc"


def test_find_stop_string():
    assert find_stop_string("hello world", 3, ["wor"], False) == ("wor", 6)
    assert find_stop_string("hello world", 3, ["wor"], True) == ("wor", 9)
    # only matches the new characters can complete
    assert find_stop_string("hello world", 1, ["hell"], False) is None
    # the earliest occurrence wins, whatever the list order
    assert find_stop_string("abcdef", 6, ["de", "bc"], False) == ("bc", 1)
    assert find_stop_string("abc", 1, ["x"], False) is None


def test_visible_text_holds_back_a_possible_stop_prefix():
    assert visible_text("hello wo", ["world", "!"], finished=False) == "hell"
    assert visible_text("hello wo", ["world"], finished=True) == "hello wo"
    assert visible_text("hello wo", [], finished=False) == "hello wo"
    assert visible_text("hello", ["!"], finished=False) == "hello"


# ---------------------------------------------------------------------- token pieces
def _stream(tokenizer, seed: int, n: int) -> list[int]:
    """Ids a model might write: text encoded (multi-byte characters split across tokens)
    and random ids of the whole vocabulary (byte fragments, special tokens) mixed."""
    import random

    rng = random.Random(seed)
    text = tokenizer.encode("Grüße, 東京🙂 naïve café: x = [1, 2]; print(x)\n\n" * 3)
    ids = []
    while len(ids) < n:
        if rng.random() < 0.5:
            start = rng.randrange(len(text))
            ids += text[start:start + rng.randint(1, 12)]
        else:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
    return ids[:n]


def test_token_pieces_of_a_byte_level_tokenizer(tokenizer):
    pieces = TokenPieces.of(tokenizer)
    assert pieces is not None
    word = tokenizer.encode(" the")
    assert len(word) == 1 and pieces.get(word[0]) == " the"
    assert pieces.get(tokenizer.eos_token_id) == ""  # special: text only when not skipped
    split = [t for t in tokenizer.encode("東") if "\ufffd" in tokenizer.decode([t])]
    assert split and all(pieces.get(t) == "" for t in split)  # half a character
    assert pieces.get(len(tokenizer)) == pieces.get(-1) == ""  # outside the vocabulary


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip_special", [True, False])
def test_pieces_give_the_decoded_text_step_for_step(tokenizer, seed, skip_special):
    """With and without token pieces, every step emits the same text (skips and flushes
    included), whatever the ids."""
    import random

    rng = random.Random(seed)
    pieces = TokenPieces.of(tokenizer)
    prompt = _stream(tokenizer, seed + 100, 7)
    fast, slow = (IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special,
                                         pieces=p) for p in (pieces, None))
    fast_steps = 0
    for token in _stream(tokenizer, seed, 400):
        action = rng.random()
        if action < 0.02:
            fast.skip(token), slow.skip(token)
        elif action < 0.04:
            assert fast.flush() == slow.flush()
        else:
            joined = fast._joined and fast._read_offset == len(fast._ids)
            delta = fast.add(token)
            assert delta == slow.add(token)
            fast_steps += joined and bool(pieces.get(token))
        assert fast.text == slow.text
    assert fast.flush() == slow.flush() and fast.text == slow.text
    assert fast_steps > 100  # most steps took the pieces


class _Decoding:
    """A tokenizer whose decode is another function of the ids (the byte-level decoder
    kept): what TokenPieces.of must refuse."""

    def __init__(self, tokenizer, decode):
        self._tokenizer, self._decode = tokenizer, decode
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.all_special_ids = tokenizer.all_special_ids

    def __len__(self):
        return len(self._tokenizer)

    def encode(self, text, **kwargs):
        return self._tokenizer.encode(text, **kwargs)

    def decode(self, ids, **kwargs):
        return self._decode(self._tokenizer.decode(ids, **kwargs))


def test_no_pieces_where_the_decode_is_not_the_tokens_joined(tokenizer):
    from tokenizers import Tokenizer, decoders, models

    assert TokenPieces.of(_Decoding(tokenizer, lambda t: t)) is not None
    # spaces cleaned up before punctuation, as transformers' clean_up_tokenization does
    assert TokenPieces.of(_Decoding(tokenizer, lambda t: t.replace(" .", "."))) is None
    # a leading space dropped (a SentencePiece-style decode)
    assert TokenPieces.of(_Decoding(tokenizer, lambda t: t[1:] if t[:1] == " " else t)) is None

    class _OtherDecoder:  # a decoder that is not byte-level
        backend_tokenizer = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
        backend_tokenizer.decoder = decoders.WordPiece()

    assert TokenPieces.of(_OtherDecoder()) is None
